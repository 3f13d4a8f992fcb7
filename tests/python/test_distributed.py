"""Multi-process tests: gloo on localhost, world 2 and 4, each bounded by a
timeout (a hang is a failure, never a stuck suite)."""

import os
import signal
import tempfile
import time

import pytest
import torch.multiprocessing as mp

import dist_workers


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


@pytest.mark.parametrize("world", [2, 4])
def test_exchange_protocols(world):
    spawn(dist_workers.exchange_worker, world, 120)


@pytest.mark.parametrize("world", [2, 4])
def test_kda_over_group(world):
    spawn(dist_workers.kda_worker, world, 150)


@pytest.mark.parametrize("world", [2, 3])
def test_errors(world):
    spawn(dist_workers.error_worker, world, 90)


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_agree_and_fail_alike(world):
    spawn(dist_workers.trust_worker, world, 150)


@pytest.mark.parametrize("worker", ["first_call_timeout_worker", "first_exchange_timeout_worker"])
def test_timeout_bounds_the_first_call(worker):
    spawn(getattr(dist_workers, worker), 2, 60)
