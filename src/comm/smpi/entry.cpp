// kdacp-smpi's entry point when it is run as a program, outside smpirun.
//
// kdacp-smpi is a shared object with main() (tools/CMakeLists.txt): smpirun
// dlopen()s it and calls main() once per simulated rank, and glibc refuses
// to dlopen a position-independent executable. Run directly, the kernel
// maps it like a static PIE and jumps to its ELF entry point; a shared
// object has none (e_entry 0) and no program interpreter, so the jump lands
// on the ELF header and the process dies of SIGSEGV before any code runs,
// even for `--help`. The link sets the entry point to the function below
// (-e, src/comm/smpi/CMakeLists.txt); dlopen never calls it, so smpirun's
// runs are unchanged.
//
// Nothing has been loaded or relocated when the kernel jumps here: no
// dynamic loader ran, so no library (libc, SimGrid) is mapped, no GOT or
// PLT entry is filled, and there is no thread pointer (TLS, stack
// canary). The function therefore reads only its own constant text through
// PC-relative addresses and calls the kernel directly: write(2) the
// message, exit_group(2) with status 2, the CLI's status for a usage or
// environment error (docs/limits.md).

namespace {

constexpr char kMessage[] =
    "kdacp-smpi: error: kdacp-smpi is the CLI built for SimGrid's SMPI and runs only under smpirun: "
    "smpirun -np P [smpirun options] kdacp-smpi <command> [flags] (docs/scale.md); "
    "for a plain run use kdacp\n";

}  // namespace

extern "C" [[noreturn]] __attribute__((used, no_stack_protector,
                                       no_sanitize("address", "undefined", "thread"))) void
kdacp_smpi_outside_smpirun() {
  constexpr long kStderr = 2, kExitStatus = 2;
#if defined(__x86_64__)
  constexpr long kWrite = 1, kExitGroup = 231;
  long rc = 0;
  asm volatile("syscall"
               : "=a"(rc)
               : "a"(kWrite), "D"(kStderr), "S"(kMessage), "d"(sizeof kMessage - 1)
               : "rcx", "r11", "memory");
  (void)rc;  // what write returned: nothing to do if stderr is closed
  asm volatile("syscall" : : "a"(kExitGroup), "D"(kExitStatus) : "rcx", "r11", "memory");
#elif defined(__aarch64__)
  register long x8 asm("x8") = 64;  // write
  register long x0 asm("x0") = kStderr;
  register const char* x1 asm("x1") = kMessage;
  register long x2 asm("x2") = sizeof kMessage - 1;
  asm volatile("svc #0" : "+r"(x0) : "r"(x8), "r"(x1), "r"(x2) : "memory");
  x8 = 94;  // exit_group
  x0 = kExitStatus;
  asm volatile("svc #0" : : "r"(x8), "r"(x0) : "memory");
#else
#error "the direct-run entry knows the system calls of x86-64 and AArch64 Linux only (CMake adds it for those)"
#endif
  __builtin_unreachable();
}
