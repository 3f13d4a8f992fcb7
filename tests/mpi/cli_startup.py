#!/usr/bin/env python3
"""--timeout bounds MPI's start-up too (issue 18): under mpirun, process 1 of
the job never reaches MPI_Init (it runs `sleep` instead of kdacp), so
process 0 waits in MPI_Init for it, where no communicator timeout applies.
With --timeout 3, process 0 must give up with a message naming MPI_Init and
the timeout, and the job must end non-zero instead of hanging, with no
--out written.

usage: cli_startup.py KDACP MPIEXEC [MPIEXEC FLAGS...]
"""
import os
import signal
import subprocess
import sys
import tempfile

END_BOUND = 60  # seconds for the whole job; without the bound it never ends


def main():
    kdacp, mpiexec, flags = sys.argv[1], sys.argv[2], sys.argv[3:]
    out = os.path.join(tempfile.mkdtemp(prefix="kdacp_cli_startup_"), "out")
    cmd = [mpiexec, *flags, "-np", "1", kdacp, "exchange", "--backend", "mpi", "--timeout", "3", "--heads", "2",
           "--key-dim", "32", "--value-dim", "32", "--out", out, ":", "-np", "1", "sleep", "600"]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    try:
        output, _ = job.communicate(timeout=END_BOUND)
    except subprocess.TimeoutExpired:
        job.terminate()  # mpirun ends its processes on SIGTERM (a SIGKILL would orphan `sleep`)
        try:
            output, _ = job.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            output, _ = job.communicate()
        sys.exit(f"FAIL: the job still ran {END_BOUND} s after its start (MPI_Init waits forever):\n{output}")
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    if job.returncode == 0:
        sys.exit(f"FAIL: the job exited 0:\n{output}")
    want = "did not complete within --timeout 3 s: a process of the job never reached MPI_Init"
    if want not in output:
        sys.exit(f"FAIL: no message '{want}':\n{output}")
    if os.path.exists(out):
        sys.exit(f"FAIL: {out} was written")
    print(f"exit {job.returncode}: {want}")
    print("PASS")


if __name__ == "__main__":
    main()
