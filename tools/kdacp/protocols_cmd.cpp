// kdacp protocols: the registry's rows as a table, or as the Markdown table
// that README.md and docs/protocols.md carry (kdacp/report/protocols.hpp).
#include <memory>

#include "commands.hpp"
#include "kdacp/report/protocols.hpp"

namespace kdacp::cli {

void add_protocols_command(CLI::App& app) {
  auto markdown = std::make_shared<bool>(false);
  CLI::App* cmd = app.add_subcommand(
      "protocols", "list the state exchange protocols: class, knobs, memory, error bound");
  cmd->add_flag("--markdown", *markdown, "print the Markdown table of README.md and docs/protocols.md");
  cmd->callback([markdown] { report::print_protocols(*markdown); });
}

}  // namespace kdacp::cli
