#include "flags.hpp"

#include <sstream>

#include "kdacp/error.hpp"

namespace kdacp::cli {

std::string flag_name(const std::string& names) {
  std::stringstream in(names);
  std::string name, first;
  while (std::getline(in, name, ',')) {
    if (first.empty()) first = name;
    if (name.rfind("--", 0) == 0) return name;
  }
  return first;
}

CLI::Option* add_int_list(CLI::App& cmd, const std::string& names, std::vector<std::size_t>& values,
                          const std::string& help, const IntRange& range) {
  const std::string flag = flag_name(names);
  return cmd
      .add_option_function<std::string>(
          names,
          [&values, range, flag](const std::string& text) {
            values.clear();
            std::stringstream in(text);
            std::string item;
            std::size_t i = 0;
            // getline drops a trailing empty entry ("3,4,"): catch it here.
            if (!text.empty() && text.back() == ',')
              throw InvalidArgument(fmt::format("{} '{}' ends with a comma, expected a comma-separated list, each {}",
                                                flag, text, describe(range)));
            while (std::getline(in, item, ','))
              values.push_back(
                  static_cast<std::size_t>(parse_integer(item, range, fmt::format("{} entry {}", flag, i++))));
            if (values.empty()) parse_integer(text, range, flag);  // "": the parser's message
          },
          help + " (comma-separated, each " + describe(range) + ")")
      ->type_name("N,N,...");
}

CLI::Option* add_choice(CLI::App& cmd, const std::string& names, std::string& value, const std::string& help,
                        const std::vector<std::string>& words) {
  std::vector<std::pair<std::string, std::string>> choices;
  for (const std::string& w : words) choices.emplace_back(w, w);
  return add_mapped_choice<std::string>(cmd, names, value, help, std::move(choices));
}

CLI::Option* add_real(CLI::App& cmd, const std::string& names, double& value, const std::string& help,
                      const RealRange& range) {
  const std::string flag = flag_name(names);
  return cmd
      .add_option_function<std::string>(
          names, [&value, range, flag](const std::string& t) { value = parse_real(t, range, flag); },
          help + " (" + describe(range) + ")")
      ->type_name("FLOAT")
      ->default_str(fmt::format("{:g}", value));
}

CLI::Option* add_quantity(CLI::App& cmd, const std::string& names, std::string& text, const std::string& help,
                          Quantity kind) {
  const std::string flag = flag_name(names);
  return cmd.add_option_function<std::string>(
      names,
      [&text, kind, flag](const std::string& t) {
        if (kind == Quantity::bytes) parse_bytes(t, flag);
        else if (kind == Quantity::seconds) parse_seconds(t, flag);
        else parse_rate(t, flag);
        text = t;
      },
      help);
}

std::array<CLI::Option*, 4> add_bhkv_flags(CLI::App& cmd, std::size_t& batch, std::size_t& heads,
                                           std::size_t& key_dim, std::size_t& value_dim) {
  return {add_int(cmd, "--batch,-B", batch, "batch size B", kSizeRange), add_int(cmd, "--heads,-H", heads, "heads H", kSizeRange),
          add_int(cmd, "--key-dim,-K", key_dim, "key dim K", kDimRange),
          add_int(cmd, "--value-dim,-V", value_dim, "value dim V", kDimRange)};
}

void check_value_heads(std::size_t heads, std::size_t value_heads) {
  if (value_heads == 0 || (heads > 0 && value_heads % heads == 0)) return;
  throw InvalidArgument(fmt::format("--value-heads is '{}', expected a multiple of --heads {} (each query/key head "
                                    "serves HV/H value heads; 0: the same as --heads)",
                                    value_heads, heads));
}

CLI::Option* add_path(CLI::App& cmd, const std::string& names, std::string& path, const std::string& help,
                      const std::string& what) {
  const std::string flag = flag_name(names);
  return cmd
      .add_option_function<std::string>(
          names,
          [&path, flag, what](const std::string& t) {
            if (t.empty())
              throw InvalidArgument(flag + " is '', expected " + what + " (write . for the current directory)");
            path = t;
          },
          help)
      ->type_name("PATH");
}

void reject_repeated_flags(CLI::App& app) {
  for (CLI::Option* opt : app.get_options())
    if (opt->get_expected_max() == 0 && opt != app.get_help_ptr() && opt != app.get_version_ptr())
      opt->multi_option_policy(CLI::MultiOptionPolicy::Throw);
  for (CLI::App* sub : app.get_subcommands({})) reject_repeated_flags(*sub);
}

CLI::Option* add_max_memory(CLI::App& cmd, std::string& text) {
  return add_quantity(cmd, "--max-memory", text,
                      "refuse to start when the run's estimated memory exceeds this, e.g. 8GiB "
                      "(default: what the machine has available now, MemAvailable or the cgroup's limit)",
                      Quantity::bytes);
}

}  // namespace kdacp::cli
