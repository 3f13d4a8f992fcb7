#!/usr/bin/env python3
"""`kdacp exchange --backend mpi --timeout 2` on 4 ranks with rank 1 stopped
(SIGSTOP: alive but silent) or killed (SIGKILL) in the middle of its timed
calls: the job must end non-zero within a bound, with a message naming rank 1,
and leave no output file.

usage: cli_fault.py stop|kill KDACP MPIEXEC [MPIEXEC FLAGS...]
"""
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

# Seconds for rank 1 to be found past its start-up. 30 s once ran out in a
# fresh-clone make test (the sanitizer builds beside the suite on 2 cores).
LAUNCH_BOUND = 60
END_BOUND = 15     # seconds from the signal to the end of the job (timeout 2 s)


def rank_process(launcher_pid, rank):
    """The pid of `rank` among the launcher's children, or None."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != launcher_pid:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if f"OMPI_COMM_WORLD_RANK={rank}".encode() in env:
            return int(entry)
    return None


def cpu_seconds(pid):
    """CPU seconds `pid` has run (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main():
    mode, kdacp, mpiexec, flags = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    sig = {"stop": signal.SIGSTOP, "kill": signal.SIGKILL}[mode]
    out = tempfile.mkdtemp(prefix="kdacp_cli_fault_")
    # Enough timed calls to outlast the test by far: the signal lands in them.
    cmd = [mpiexec, "-np", "4", *flags, kdacp, "exchange", "--backend", "mpi", "--timeout", "2",
           "--protocol", "allgather", "--heads", "2", "--key-dim", "32", "--value-dim", "32",
           "--repeat", "100000", "--out", out]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           start_new_session=True)
    target = None
    try:
        # Past MPI start-up (a rank stopped inside MPI_Init would block its
        # peers' MPI_Init, which no kdacp timeout bounds): rank 1 has run its
        # calls for a while.
        deadline = time.monotonic() + LAUNCH_BOUND
        while time.monotonic() < deadline and job.poll() is None:
            target = target or rank_process(job.pid, 1)
            if target and cpu_seconds(target) > 0.5:
                break
            time.sleep(0.05)
        else:
            # Say which: the job ended, rank 1 never appeared, or it ran too little.
            state = (f"the job ended with exit {job.returncode}" if job.poll() is not None
                     else "rank 1 was not found among mpiexec's children" if not target
                     else f"rank 1 (pid {target}) ran {cpu_seconds(target):.2f} s of CPU")
            os.killpg(job.pid, signal.SIGKILL)
            text = job.communicate()[0].decode(errors="replace")
            sys.exit(f"FAIL: rank 1 did not run 0.5 s of CPU within {LAUNCH_BOUND} s: {state}\n"
                     f"{text[-2000:]}")
        os.kill(target, sig)
        signalled = time.monotonic()
        try:
            output, _ = job.communicate(timeout=END_BOUND)
        except subprocess.TimeoutExpired:
            sys.exit(f"FAIL: the job still ran {END_BOUND} s after rank 1 got {sig.name}")
        elapsed = time.monotonic() - signalled
    finally:
        if job.poll() is None:
            if target:
                os.kill(target, signal.SIGCONT)
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    text = output.decode(errors="replace")
    print(text)
    print(f"exit {job.returncode}, {elapsed:.1f} s after {sig.name}")
    if job.returncode == 0:
        sys.exit("FAIL: the job exited 0")
    # A rank stopped between an all-gather's header exchange and its data
    # transfer cannot be told apart inside MPI's collective: the message then
    # names the operation and its group instead.
    expect = {
        "stop": r"kdacp: error: rank \d: .*timed out after 2000 ms (waiting for peer rank(\(s\))? 1\b"
                r"|in the data transfer with the group's members \(global ranks \[0,1,2,3\]\))",
        "kill": r"process rank 1 with PID \d+ on node \S+ exited on signal 9",
    }[mode]
    if not re.search(expect, text):
        sys.exit(f"FAIL: no line matches {expect!r}")
    written = os.listdir(out)
    if written:
        sys.exit(f"FAIL: the failed job wrote {written} into --out")
    os.rmdir(out)
    print("PASS")


if __name__ == "__main__":
    main()
