"""Multi-process tests: gloo on localhost, world 2 and 4, each bounded by a
timeout (a hang is a failure, never a stuck suite)."""


import pytest

import dist_workers
from spawn_ranks import spawn


@pytest.mark.parametrize("world", [2, 4])
def test_exchange_protocols(world):
    spawn(dist_workers.exchange_worker, world, 120)


@pytest.mark.parametrize("world", [2, 4])
def test_kda_over_group(world):
    spawn(dist_workers.kda_worker, world, 150)


@pytest.mark.parametrize("world", [2, 4])
def test_state_gradient_is_this_ranks_share(world):
    spawn(dist_workers.share_worker, world, 120)


@pytest.mark.parametrize("world", [2, 3])
def test_errors(world):
    spawn(dist_workers.error_worker, world, 90)


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_agree_and_fail_alike(world):
    spawn(dist_workers.trust_worker, world, 150)


@pytest.mark.parametrize("worker", ["first_call_timeout_worker", "first_exchange_timeout_worker"])
def test_timeout_bounds_the_first_call(worker):
    spawn(getattr(dist_workers, worker), 2, 60)
