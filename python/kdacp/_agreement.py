"""Cross-rank agreement: the one fixed-size gather in which every rank of a
group learns whether all passed the same arguments (_Fingerprint), and the
comm backend kept per group, so the layers cached for it stay valid."""

import hashlib
import struct

import torch
import torch.distributed as dist

from kdacp._comm import backend_for
from kdacp._common import _expected_cuts, _parse_bytes, _segments, _ulysses


def _agree(backend, row, what):
    """All-gathers an int64 row from every rank (one fixed-size collective,
    bounded by the backend's timeout); returns the [size, len(row)] table."""
    mine = torch.tensor(row, dtype=torch.int64)
    table = torch.zeros(backend.size, mine.numel(), dtype=torch.int64)
    table[backend.rank] = mine
    try:
        backend.all_gather(table.view(torch.uint8).reshape(-1))
    except (TimeoutError, RuntimeError) as e:
        raise RuntimeError(f"rank {dist.get_rank()}: {what} check: {e}") from None
    return table.numpy()


def _digest(*parts):
    """A signed 64-bit hash of the exact bytes of `parts` (bytes, or text)."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        b = p if isinstance(p, bytes) else repr(p).encode()
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return int.from_bytes(h.digest(), "little", signed=True)


def _float_bits(x):
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _bits_float(b):
    return struct.unpack("<d", struct.pack("<q", int(b)))[0]


class _Fingerprint:
    """The arguments every rank must pass alike, as one fixed-size int64 row:
    (name, value, shown) per argument, where shown(value) prints it (None:
    a hash, printed as such). ok=False marks a rank whose own checks failed:
    its error is raised on it, and its peers name it, instead of them waiting
    for it in the next collective."""

    def __init__(self, fields):
        # Every rank sends a row of the same length, whatever its own checks
        # found (a shorter row would abort the process inside gloo).
        self.fields = tuple(fields)
        self.names, self.values, self.shows = [], [], []

    def add(self, name, value, show=str):
        assert name == self.fields[len(self.names)], (name, self.fields)
        self.names.append(name)
        self.values.append(int(value))
        self.shows.append(show)

    def add_hash(self, name, *parts):
        self.add(name, _digest(*parts), None)

    def check(self, backend, what, ok=True, error=None, extra=()):
        """Gathers [ok] + fingerprint + extra (per-rank values, not compared)
        from every rank. Raises on every rank: `error` on the ranks that
        failed their own checks, ValueError naming them on the others, and
        ValueError naming each argument that differs and which global ranks
        hold which value. Returns the gathered `extra` columns."""
        if ok:
            assert len(self.values) == len(self.fields), (self.names, self.fields)
        row = [int(ok)] + (self.values if ok else [0] * len(self.fields)) + \
            [int(x) for x in extra]
        table = _agree(backend, row, what)
        ranks = backend.global_ranks
        me = dist.get_rank()
        if error is not None:
            raise error
        bad = [ranks[j] for j in range(backend.size) if not table[j, 0]]
        if bad:
            raise ValueError(f"rank {me}: {what}: global rank(s) {bad} rejected their own "
                             "arguments (their error says why); nothing was sent")
        diffs = []
        for c, (name, show) in enumerate(zip(self.names, self.shows)):
            col = table[:, 1 + c]
            if (col == col[0]).all():
                continue
            groups = {}
            for j, x in enumerate(col.tolist()):
                groups.setdefault(x, []).append(ranks[j])
            diffs.append(f"{name} differs: " + "; ".join(
                f"global rank(s) {g}" + ("" if show is None else f": {show(x)}")
                for x, g in groups.items()))
        if diffs:
            raise ValueError(f"rank {me}: {what} called with different arguments on the "
                             "group's ranks: " + "; ".join(diffs) + " (every rank must pass the same)")
        return table[:, 1 + len(self.fields):]


_OPTION_FIELDS = ("protocol", "allgather_group_size", "segments", "memory_budget_bytes",
                  "allow_reassociation", "calibration", "expected_shape", "expected_cuts",
                  "timeout", "ulysses")


def _options_fingerprint(fp, options, protocol, group_size, timeout_s):
    """The exchange's arguments that must match: protocol, width, options that
    shape the messages, timeout (threads and check_ranks are per-rank)."""
    fp.add_hash("protocol", protocol)
    fp.add("allgather_group_size", group_size)
    fp.add("segments", _segments(options))
    budget = _parse_bytes(options.get("memory_budget_bytes", 0))  # < 2^64: as signed bits
    fp.add("memory_budget_bytes", budget - (1 << 64) if budget >= 1 << 63 else budget,
           lambda b: str(b % (1 << 64)))
    fp.add("allow_reassociation", bool(options.get("allow_reassociation", False)))
    fp.add_hash("calibration", options.get("calibration", "") or "")
    shape = options.get("expected_shape")
    fp.add_hash("expected_shape", None if shape is None else [int(x) for x in shape])
    fp.add_hash("expected_cuts", _expected_cuts(options))
    fp.add("timeout", _float_bits(timeout_s), lambda b: f"{_bits_float(b)!r} s")
    fp.add("ulysses", _ulysses(options), lambda u: "auto" if u == 0 else str(u))


_BACKENDS = {}


def _group_backend(group, timeout_s):
    """One backend per (group, timeout), reused across kda calls, so the
    layers cached for it stay valid. Only the first call on a group is
    collective (it gathers the members, bounded by timeout_s); a new timeout
    on a known group reuses them, so ranks that pass different timeouts still
    meet in the agreement that names the difference. The group must be live
    (check_group)."""
    key = (id(group), timeout_s)
    entry = _BACKENDS.get(key)
    if entry is not None and entry[0] is group:
        return entry[1]
    known = next((e[1] for k_, e in _BACKENDS.items() if k_[0] == id(group) and e[0] is group),
                 None)
    if known is not None:
        backend = known.with_timeout(timeout_s)
    else:
        try:
            backend = backend_for(group, timeout_s)
        except TimeoutError as e:
            raise RuntimeError(str(e)) from None
    _BACKENDS[key] = (group, backend)
    return backend


