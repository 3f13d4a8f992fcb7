// kdacp: context-parallel state exchange for KDA-style linear attention.
#include <cstdio>
#include <exception>

#include "commands.hpp"
#include "kdacp/error.hpp"

int main(int argc, char** argv) {
  CLI::App app{
      "kdacp: context-parallel state exchange of Kimi Delta Attention and other linear "
      "attentions with an affine recurrent state"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "kdacp 0.1.0");
  kdacp::cli::add_run_command(app);
  kdacp::cli::add_exchange_command(app);
  kdacp::cli::add_bench_command(app);
  kdacp::cli::add_kda_command(app);
  kdacp::cli::add_plan_command(app);
  kdacp::cli::add_calibrate_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const kdacp::Error& e) {
    std::fprintf(stderr, "kdacp: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kdacp: internal error: %s\n", e.what());
    return 3;
  }
  return 0;
}
