// kdacp: context-parallel state exchange for KDA-style linear attention.
#include <cstdio>
#include <exception>
#include <filesystem>
#include <new>

#include "commands.hpp"
#include "kdacp/error.hpp"

int main(int argc, char** argv) {
  CLI::App app{
      "kdacp: context-parallel state exchange of Kimi Delta Attention and other linear "
      "attentions with an affine recurrent state.\n"
      "Exit status: 0 success, 1-127 an error (2: bad input, a file or the run failed; 105-110: a flag "
      "CLI11 could not parse), 3: a bug (internal error)"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "kdacp 0.1.0");
  kdacp::cli::add_run_command(app);
  kdacp::cli::add_exchange_command(app);
  kdacp::cli::add_bench_command(app);
  kdacp::cli::add_kda_command(app);
  kdacp::cli::add_plan_command(app);
  kdacp::cli::add_calibrate_command(app);
  kdacp::cli::add_protocols_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const kdacp::Error& e) {
    std::fprintf(stderr, "kdacp: error: %s\n", e.what());
    return 2;
  } catch (const std::filesystem::filesystem_error& e) {
    std::fprintf(stderr, "kdacp: error: cannot access %s: %s\n", e.path1().string().c_str(),
                 e.code().message().c_str());
    return 2;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr,
                 "kdacp: error: out of memory: an allocation failed; use smaller sizes or fewer ranks "
                 "(commands that allocate check --max-memory first)\n");
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kdacp: internal error: %s\n", e.what());
    return 3;
  }
  return 0;
}
