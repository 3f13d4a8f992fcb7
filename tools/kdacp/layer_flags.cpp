#include "layer_flags.hpp"

#include <sstream>

#include "flags.hpp"
#include "kdacp/error.hpp"

namespace kdacp::cli {

void add_layout_flags(CLI::App& cmd, LayoutFlags& flags) {
  cmd.add_option("--layout", flags.layout,
                 "where tokens live: contiguous (rank r holds the r-th run of tokens) or zigzag (2P parts, rank r "
                 "holds parts r and 2P-1-r; needs T >= 2P and a protocol that takes layouts)")
      ->check(CLI::IsMember({"contiguous", "zigzag"}))
      ->capture_default_str();
  add_int_list(cmd, "--split", flags.split,
               "tokens per rank of the contiguous layout, P entries summing to T (default: ceil/floor of T/P)",
               IntRange{1, std::uint64_t{1} << 40});
}

kda::Algorithm parse_algorithm_flag(const std::string& text, const std::string& flag) {
  try {
    return kda::parse_algorithm(text.c_str());
  } catch (const InvalidArgument&) {
    std::ostringstream what;
    what << flag << " is '" << text << "', expected 'recurrent' (token by token, the reference) or 'chunk' "
         << "(chunkwise WY form, " << kda::kChunkSize << " tokens per chunk)";
    throw InvalidArgument(what.str());
  }
}

CLI::Option* add_algorithm_flag(CLI::App& cmd, kda::Algorithm& algorithm) {
  return cmd
      .add_option_function<std::string>(
          "--algorithm", [&algorithm](const std::string& t) { algorithm = parse_algorithm_flag(t, "--algorithm"); },
          "how the KDA layer computes: recurrent (token by token, the reference) or chunk (chunkwise WY form); "
          "both give the same results up to rounding")
      ->type_name("recurrent|chunk")
      ->default_str(kda::algorithm_name(algorithm));
}

void check_layout_flags(const LayoutFlags& flags) {
  if (flags.layout == "zigzag" && !flags.split.empty())
    throw InvalidArgument("--split applies to --layout contiguous only, not to --layout zigzag");
}

testing::LayoutSpec layout_spec(const LayoutFlags& flags, std::size_t tokens, std::size_t ranks) {
  check_layout_flags(flags);
  testing::LayoutSpec spec{flags.layout == "zigzag", flags.split};
  try {
    spec.build(tokens, ranks);
  } catch (const InvalidArgument& e) {
    std::ostringstream what;
    if (spec.zigzag) {
      what << "--layout zigzag on P = " << ranks << " ranks: ";
    } else if (!flags.split.empty()) {
      what << "--split " << spec.name().substr(std::string("contiguous ").size()) << " on P = " << ranks
           << " ranks, T = " << tokens << ": ";
    } else {
      what << "P = " << ranks << " ranks for T = " << tokens << " tokens: ";
    }
    throw InvalidArgument(what.str() + e.what());
  }
  return spec;
}

}  // namespace kdacp::cli
