// Every numeric flag of every subcommand goes through these: the text is
// parsed and range-checked by kdacp/units.hpp (no sign wrap, no overflow,
// finite reals) before the value is stored; a bad value throws
// InvalidArgument naming the flag, the text and the limits. The limits are
// shared so that `plan` accepts exactly the shapes `exchange` runs.
#pragma once

#include <array>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "kdacp/error.hpp"
#include "kdacp/report/exchange_flags.hpp"
#include "kdacp/summary.hpp"
#include "kdacp/units.hpp"

namespace kdacp::cli {

inline constexpr IntRange kDimRange{kMinDim, kMaxDim};  // K, V: any integer in [1, 256]
inline constexpr IntRange kSizeRange{1, 65536};                       // B, H, B·H
using report::kRanksRange;                                            // P of a run
inline constexpr RealRange kPositive{0, std::numeric_limits<double>::max(), true};
inline constexpr RealRange kMinTimeRange{0, 3600, true};  // seconds a measurement repeats

// The option's long name ("--key-dim") from CLI11's "--key-dim,-K".
std::string flag_name(const std::string& names);

template <class T>
CLI::Option* add_int(CLI::App& cmd, const std::string& names, T& value, const std::string& help,
                     const IntRange& range) {
  const std::string flag = flag_name(names);
  return cmd
      .add_option_function<std::string>(
          names, [&value, range, flag](const std::string& t) { value = static_cast<T>(parse_integer(t, range, flag)); },
          help + " (" + describe(range) + ")")
      ->type_name("UINT")
      ->default_str(fmt::format("{}", value));
}

template <class T>
CLI::Option* add_ints(CLI::App& cmd, const std::string& names, std::vector<T>& values, const std::string& help,
                      const IntRange& range) {
  const std::string flag = flag_name(names);
  return cmd
      .add_option_function<std::vector<std::string>>(
          names,
          [&values, range, flag](const std::vector<std::string>& texts) {
            values.clear();
            for (const std::string& t : texts) values.push_back(static_cast<T>(parse_integer(t, range, flag)));
          },
          help + " (each " + describe(range) + ")")
      ->type_name("UINT ...")
      ->default_str(fmt::format("{}", fmt::join(values, " ")));
}

// A comma-separated list "3,5,4" (one argument), each entry an integer in
// `range`; a bad entry throws InvalidArgument naming the flag, the entry's
// position and its text.
CLI::Option* add_int_list(CLI::App& cmd, const std::string& names, std::vector<std::size_t>& values,
                          const std::string& help, const IntRange& range);

CLI::Option* add_real(CLI::App& cmd, const std::string& names, double& value, const std::string& help,
                      const RealRange& range);

// One of named choices ("--kernel best|simd|scalar", the help's type
// name); another text throws InvalidArgument naming the flag, the text and
// the choices.
template <class T>
CLI::Option* add_mapped_choice(CLI::App& cmd, const std::string& names, T& value, const std::string& help,
                        std::vector<std::pair<std::string, T>> choices) {
  const std::string flag = flag_name(names);
  std::vector<std::string> words;
  std::string current;
  for (const auto& [word, v] : choices) {
    words.push_back(word);
    if (v == value) current = word;
  }
  return cmd
      .add_option_function<std::string>(
          names,
          [&value, flag, choices, words](const std::string& t) {
            for (const auto& [word, v] : choices)
              if (t == word) return void(value = v);
            throw InvalidArgument(fmt::format("{} is '{}', expected one of {}", flag, t, fmt::join(words, ", ")));
          },
          help)
      ->type_name(fmt::format("{}", fmt::join(words, "|")))
      ->default_str(current);
}

// A text flag whose value is one of `words`.
CLI::Option* add_choice(CLI::App& cmd, const std::string& names, std::string& value, const std::string& help,
                        const std::vector<std::string>& words);

// A quantity with a unit, kept as text and checked at parse time with
// parse_bytes / parse_seconds / parse_rate; converted where it is used.
enum class Quantity { bytes, seconds, rate };
CLI::Option* add_quantity(CLI::App& cmd, const std::string& names, std::string& text, const std::string& help,
                          Quantity kind);

// -B, -H, -K, -V ("batch size B", "heads H", "key dim K", "value dim V"),
// in this order (`kdacp exchange`, `kdacp plan`); returns their options.
std::array<CLI::Option*, 4> add_bhkv_flags(CLI::App& cmd, std::size_t& batch, std::size_t& heads,
                                           std::size_t& key_dim, std::size_t& value_dim);

// --value-heads against --heads (kda::validate's rule, in the flags' names):
// throws InvalidArgument unless value_heads is 0 (the same as --heads) or a
// multiple of heads.
void check_value_heads(std::size_t heads, std::size_t value_heads);

// A file or directory name. An empty text ("--out ''") throws
// InvalidArgument naming the flag: it would otherwise mean the current
// directory, or no file, without a word. `what` says which ("a directory").
CLI::Option* add_path(CLI::App& cmd, const std::string& names, std::string& path, const std::string& help,
                      const std::string& what);

// Every on/off flag of `app` and its subcommands (--json, --deterministic,
// ...) given twice is an error naming it, as a repeated option with a value
// is: CLI11 takes the last one otherwise, and `--deterministic=false
// --deterministic` would silently mean one of them.
void reject_repeated_flags(CLI::App& app);

// --max-memory: what a command may allocate; empty text means what the
// machine has available now (max_memory_bytes in kdacp/admission.hpp).
CLI::Option* add_max_memory(CLI::App& cmd, std::string& text);

}  // namespace kdacp::cli
