// kdacp: context-parallel state exchange for KDA-style linear attention.
#include <cstdio>
#include <exception>
#include <filesystem>
#include <new>

#include "commands.hpp"
#include "flags.hpp"
#include "kdacp/error.hpp"

int main(int argc, char** argv) {
  CLI::App app{
      "kdacp: context-parallel state exchange of Kimi Delta Attention and other linear "
      "attentions with an affine recurrent state.\n"
      "Exit status: 0 success; 2 an error, with a message saying what (a flag, an input, a file, memory, "
      "a peer or the results); 3 a bug (internal error)"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "kdacp 0.1.0");
  kdacp::cli::add_run_command(app);
  kdacp::cli::add_exchange_command(app);
  kdacp::cli::add_bench_command(app);
  kdacp::cli::add_kda_command(app);
  kdacp::cli::add_plan_command(app);
  kdacp::cli::add_calibrate_command(app);
  kdacp::cli::add_protocols_command(app);
  kdacp::cli::reject_repeated_flags(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version end the parse as a "success"; every other parse
    // failure (unknown or repeated flag, missing or unreadable value) is an
    // error like any other: exit 2, one line naming the flag.
    if (e.get_exit_code() == 0) return app.exit(e);
    std::fprintf(stderr, "kdacp: error: %s (--help lists the flags)\n", e.what());
    return 2;
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
