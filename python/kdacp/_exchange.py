"""The state exchange over a torch group (build_kda_state_cp, StateExchange)
and the serial fold (merge_affine_summaries), exported by kdacp.torch."""

import torch

from kdacp import _kdacp
from kdacp._comm import backend_for, reject
from kdacp._common import (_DTYPES, _check_state_tensor, _desc, _group_size, _options, _threads,
                           _timeout, _ulysses, _viewable)


class StateExchange:
    """One rank's state exchange over a torch group (build_kda_state_cp)."""

    def __init__(self, backend, protocol, group_size, options):
        self._backend = backend
        self._protocol = protocol
        self._options = options
        self._cpp = None
        # Local checks, then one agreement (in C++): every rank learns
        # whether all ranks passed the same protocol, width, options and
        # timeout before anything that depends on them runs (a split, a
        # protocol's first message); a rank's own error reaches its peers.
        try:
            self._group_size = _group_size(group_size)
            opts = _options(options)
            self._check = bool(options.get("check_ranks", True))
        except (ValueError, TypeError) as e:
            reject(backend, "build_kda_state_cp", e)
        _kdacp.agree_exchange(backend, protocol, self._group_size, opts)
        if protocol != "auto" or "expected_shape" in options:
            self._build(None, None)

    def _build(self, shape, dtype):
        opts = _options(self._options, expected=shape, expected_dtype=dtype)
        self._cpp = _kdacp.Exchange(self._backend, self._protocol, int(self._group_size),
                                    opts, _threads(self._options))

    @property
    def method(self):
        """The protocol that runs ("auto" until an auto exchange without
        expected_shape has chosen at its first call)."""
        return self._cpp.method if self._cpp is not None else "auto"

    @property
    def exact(self):
        return self._cpp.exact if self._cpp is not None else None

    @property
    def segments(self):
        """Column segments in force (pipelined_p2p; 0: chosen per call)."""
        return self._cpp.segments if self._cpp is not None else 0

    @property
    def group_size(self):
        return self._cpp.group_size if self._cpp is not None else self._group_size

    @property
    def rank(self):
        return self._backend.rank

    @property
    def size(self):
        return self._backend.size

    def forward(self, state, matrix):
        """This rank's incoming state [B,H,K,V] from its summary: state S
        [B,H,K,V] and matrix M [B,H,K,K] (SPEC §3)."""
        return self._run(state, matrix, True, "state")

    def backward(self, gradient, matrix):
        """This rank's final-state gradient [B,H,K,V] from G [B,H,K,V] and the
        M the forward used (SPEC §4)."""
        return self._run(gradient, matrix, False, "gradient")

    def _run(self, offset, matrix, forward, name):
        _check_state_tensor(offset, name, 4)
        _check_state_tensor(matrix, "matrix", 4)
        if offset.dtype != matrix.dtype:
            raise ValueError(f"{name} is {offset.dtype} but matrix is {matrix.dtype}, "
                             "expected one dtype")
        b, h, k, v = offset.shape
        if tuple(matrix.shape) != (b, h, k, k):
            raise ValueError(f"matrix has shape {list(matrix.shape)}, expected "
                             f"[{b},{h},{k},{k}] to match {name} {list(offset.shape)}")
        if torch.is_grad_enabled() and (offset.requires_grad or matrix.requires_grad):
            raise ValueError(
                f"{name if offset.requires_grad else 'matrix'} requires grad: the exchange is "
                "not differentiable (its result would silently carry no gradient); detach the "
                "inputs, and use StateExchange.backward for the adjoint")
        if self._check:
            _kdacp.agree_exchange_call(self._backend, forward, [b, h, k, v], _DTYPES[offset.dtype])
        if self._cpp is None:
            self._build([b, h, k, v], _DTYPES[offset.dtype])
        with torch.no_grad():
            out = self._cpp.run(_desc(_viewable(offset.detach())),
                                _desc(_viewable(matrix.detach())), forward)
        return torch.from_numpy(out)


def build_kda_state_cp(group=None, protocol="auto", allgather_group_size=1, **options):
    """The kdacp state exchange over a torch.distributed group.

    group: a live ProcessGroup (None: the default group, which must be
    initialised); its ranks in group order are the chronological CP order.
    protocol: one of kdacp.exchange_methods(). Collective over the group (and,
    for the grouped protocols, their split): the ranks first compare protocol,
    allgather_group_size, the options and timeout (ValueError on every rank
    naming what differs and the ranks).

    options (ValueError naming the option when out of range, from the CLI's
    parsers): memory_budget_bytes (0/None: no budget, a positive int or
    '64MiB'), allow_reassociation, segments (0..16), calibration (a `kdacp
    calibrate` JSON file), expected_shape (B, H, K, V) for auto (without it,
    auto chooses at the first call), timeout (seconds in (0, 86400], default
    kdacp.defaults()["timeout"], 120: every wait on a peer, the first gather over the group included),
    threads (0..1024; 0 or absent: torch.get_num_threads()), check_ranks
    (default True: each call first checks that every rank passes the same
    direction and shape, so a mismatch is a ValueError on every rank).
    The exchange is not differentiable: a state or matrix that requires grad
    (with grad mode on) is a ValueError.
    """
    _options(options)  # rejects unknown options before anything is sent
    if _ulysses(options) != 1:
        raise ValueError(f"ulysses={options['ulysses']!r} is an option of the layer (kdacp.torch.kda "
                         "with group=, build_cp_context), not of the state exchange")
    if not isinstance(protocol, str):
        raise ValueError(f"protocol={protocol!r}, expected one of {_kdacp.exchange_methods()}")
    if protocol not in _kdacp.exchange_methods():
        raise ValueError(f"unknown protocol '{protocol}', expected one of "
                         f"{_kdacp.exchange_methods()}")
    _group_size(allgather_group_size)
    _threads(options)
    timeout_s = _timeout(options)
    try:
        backend = backend_for(group, timeout_s)
    except TimeoutError as e:
        raise RuntimeError(str(e)) from None
    return StateExchange(backend, protocol, allgather_group_size, dict(options))


def merge_affine_summaries(states, matrices, rank, forward=True):
    """The serial fold for one rank over stacked summaries: states (or
    gradients) [P,B,H,K,V] and matrices [P,B,H,K,K]. forward: incoming_rank =
    the chain over slots 0..rank-1 (SPEC §3); backward: the transposed chain
    over slots P-1 down to rank+1 (SPEC §4). The same operations in the same
    order as the chain, so exact protocols equal it bit for bit."""
    _check_state_tensor(states, "states", 5)
    _check_state_tensor(matrices, "matrices", 5)
    if states.dtype != matrices.dtype:
        raise ValueError(f"states are {states.dtype} but matrices are {matrices.dtype}, "
                         "expected one dtype")
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise ValueError(f"rank={rank!r}, expected an int")
    if rank < 0 or rank >= states.shape[0]:
        raise ValueError(f"rank {rank}, expected 0 <= rank < P = {states.shape[0]}")
    s = states.detach()
    m = matrices.detach()
    if s.stride(-1) != 1:
        s = s.contiguous()
    if m.stride(-1) != 1:
        m = m.contiguous()
    return torch.from_numpy(_kdacp.merge_stacked(_desc(s), _desc(m), rank, bool(forward)))

