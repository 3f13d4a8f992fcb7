"""kdacp.torch's deterministic mode (deterministic=True on kda and
chunk_kda): over gloo worlds 1, 2 and 4 every output and gradient is the
same bytes as one process (det_workers); the keyword's default and checks."""

import inspect

import pytest
import torch

import kdacp
import kdacp.torch as kt
import det_workers
from spawn_ranks import spawn


@pytest.mark.parametrize("world", [1, 2, 4])
def test_same_bytes_as_one_process(world):
    spawn(det_workers.det_worker, world, 150)


def test_default_and_bad_values():
    assert kdacp.defaults()["deterministic"] is False
    assert inspect.signature(kt.kda).parameters["deterministic"].default is False
    x, _, _ = det_workers.make(70, 1, torch.float64, seed=1, raw=False)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    for bad in (1, "yes", None):
        with pytest.raises(ValueError, match=f"deterministic={bad!r}, expected True or False"):
            kt.kda(*args, deterministic=bad)
    # One process is the mode's P = 1: the flag changes no byte.
    on, off = (kt.kda(*args, cu_seqlens=[0, 3, 70], deterministic=d)[0] for d in (True, False))
    assert det_workers.same_bytes(on, off)
