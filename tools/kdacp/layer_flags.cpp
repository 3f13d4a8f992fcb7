#include "layer_flags.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "flags.hpp"
#include "kdacp/error.hpp"

namespace kdacp::cli {

CLI::Option* add_layer_shape_flags(CLI::App& cmd, kda::Shape& shape, std::size_t& value_heads,
                                   const std::string& tokens_help) {
  add_int(cmd, "--batch,-B", shape.batch, "batch size", kSizeRange);
  CLI::Option* tokens = add_int(cmd, "--tokens,-T", shape.tokens, tokens_help, IntRange{1, 1 << 24});
  add_int(cmd, "--heads,-H", shape.heads, "query/key heads", kSizeRange);
  add_int(cmd, "--value-heads", value_heads, "value heads (multiple of --heads; 0: same)", IntRange{0, kSizeRange.max});
  add_int(cmd, "--key-dim,-K", shape.key_dim, "key dim", kDimRange);
  add_int(cmd, "--value-dim,-V", shape.value_dim, "value dim", kDimRange);
  return tokens;
}

CLI::Option* add_ulysses_flag(CLI::App& cmd, std::size_t& ulysses) {
  return cmd
      .add_option_function<std::string>(
          "--ulysses",
          [&ulysses](const std::string& t) {
            if (t == "auto") {
              ulysses = job::kUlyssesAuto;
              return;
            }
            try {
              ulysses = static_cast<std::size_t>(parse_integer(t, IntRange{1, 65536}, "--ulysses"));
            } catch (const InvalidArgument& e) {
              throw InvalidArgument(std::string(e.what()) + ", or auto");
            }
          },
          "Ulysses x state CP: head groups of U consecutive ranks exchange q, k, v, g, beta and o by all-to-all, "
          "the state exchange (--protocol) runs over the P/U ranks of each head slice with H/U heads; U divides P, "
          "H and HV; 1: off; auto: the cost model's U (with --protocol auto, its parameters: --calibration, ...) "
          "(an integer in [1, 65536], or auto)")
      ->type_name("U|auto")
      ->default_str("1");
}

std::string ulysses_flag_text(std::size_t ulysses) {
  return ulysses == job::kUlyssesAuto ? "auto" : std::to_string(ulysses);
}

std::size_t resolve_ulysses_flag(std::size_t given, const std::string& method, const kda::Shape& shape,
                                 const kda::Layout& layout, const kda::Sequences& seqs,
                                 const ExchangeOptions& options, std::size_t elem_bytes) {
  try {
    const ExchangeOptions eo = job::layer_exchange_options(
        options, shape, elem_bytes == 8 ? DType::f64 : DType::f32, layout, seqs);
    const std::size_t width = job::resolve_ulysses(given, method, shape, layout, eo, elem_bytes);
    job::check_ulysses(width, layout.ranks(), shape);
    return width;
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(fmt::format("--ulysses {}: {}", ulysses_flag_text(given), e.what()));
  }
}

void add_layout_flags(CLI::App& cmd, LayoutFlags& flags) {
  add_choice(cmd, "--layout", flags.layout,
             "where tokens live: contiguous (rank r holds the r-th run of tokens) or zigzag (2P parts, rank r holds "
             "parts r and 2P-1-r; needs T >= 2P and a protocol that takes layouts)",
             {"contiguous", "zigzag"});
  add_int_list(cmd, "--split", flags.split,
               "tokens per rank of the contiguous layout, P entries summing to T (default: ceil/floor of T/P)",
               IntRange{1, std::uint64_t{1} << 40});
}

kda::Algorithm parse_algorithm_flag(const std::string& text, const std::string& flag) {
  try {
    return kda::parse_algorithm(text.c_str());
  } catch (const InvalidArgument&) {
    throw InvalidArgument(fmt::format("{} is '{}', expected 'recurrent' (token by token, the reference) or 'chunk' "
                                      "(chunkwise WY form, {} tokens per chunk)",
                                      flag, text, kda::kChunkSize));
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

CLI::Option* add_recompute_flag(CLI::App& cmd, bool& recompute) {
  return cmd.add_flag("--recompute", recompute,
                      "chunk algorithm: the backward recomputes the forward's per-chunk states, R, Delta, L and P "
                      "instead of the forward keeping them (about 1.25x the inputs q, k, v, g less memory at "
                      "K = V = 128, a slower backward); the same results either way; default: " +
                          std::string(recompute ? "on" : "off (the forward keeps them)"));
}

CLI::Option* add_deterministic_flag(CLI::App& cmd, bool& deterministic) {
  return cmd.add_flag("--deterministic", deterministic,
                      "every output the same bytes for every P, --layout, --split, --method and --threads "
                      "(equal to P = 1): the state walks from part to part in chain order instead of the "
                      "exchange composing summaries (slower in CP; docs/determinism.md). With --algorithm "
                      "chunk a cut inside a sequence must fall on a multiple of 64 tokens of that sequence");
}

void add_packing_flags(CLI::App& cmd, report::Packing& packing, std::size_t max_tokens, const std::string& what) {
  add_int_list(cmd, "--seqlens", packing.seqlens,
               "pack sequences of these lengths into one row (B = 1; T defaults to their sum)" + what,
               IntRange{1, max_tokens});
  add_int(cmd, "--docs", packing.docs,
          "pack this many documents of random lengths (each >= 1, seeded by --seed) into one row, like --seqlens",
          IntRange{1, max_tokens})
      ->default_str("none");
}

}  // namespace kdacp::cli
