"""spawn(fn, world, timeout_s): runs fn(rank, world, init_file) on `world`
processes (torch.multiprocessing, start method spawn; gloo meets in
init_file), bounded: a rank still running at the deadline fails the test and
every process left is killed. An assertion in any rank fails the spawn."""

import os
import signal
import tempfile
import time

import torch.multiprocessing as mp


def spawn(fn, world, timeout_s):
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        ctx = mp.start_processes(fn, args=(world, init_file), nprocs=world, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise AssertionError(f"{fn.__name__} on {world} ranks ran past {timeout_s} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGKILL)
