"""kdacp's Communicator operations over a torch.distributed process group.

The C++ class ``TorchCommunicator`` (python/src/torch_comm.cpp) calls these
methods with the GIL held; buffers arrive as uint8 DLPack capsules aliasing
the C++ memory (or as uint8 tensors from kdacp's Python side) and are handed to torch.distributed as tensors over that memory
(a DLPack capsule, ``from_dlpack``: no copy, and no GIL needed when a
backend thread drops the tensor). Every wait is bounded by the communicator's
timeout: ``TimeoutError`` when it expires, ``RuntimeError`` when the operation
failed (a peer exited, a connection closed); both name the peer or the group.
Nothing here assumes gloo: only all_gather, broadcast, barrier, isend, irecv
and Work.wait(timeout), which every backend has.

split (SPEC §7): ``torch.distributed.new_group`` must be called by every
process of the default group, in the same order. A split is collective over
its communicator only, so

* when the communicator spans the whole default group (the usual CP group of
  a job, or ``group=None``) every process is in the call: the colors are
  all-gathered, and every process creates every sub-group with ``new_group``
  in ascending color order, so the sub-groups are native torch groups with
  native collectives;
* otherwise (a CP group that is a proper subgroup, e.g. one of several
  data-parallel replicas) the sub-groups are views over the parent group: the
  same p2p operations of the parent, with all_gather, broadcast and barrier
  built from isend/irecv between the view's members (tag ``VIEW_TAG``). This
  is correct for any group and never calls new_group, at a cost of
  ``size - 1`` messages per collective per rank instead of one collective.
"""

import datetime

import torch
import torch.distributed as dist
from torch.utils.dlpack import from_dlpack

from kdacp import _kdacp

# Tag of the p2p messages that make up a view's collectives: above every tag a
# protocol uses (kTagForward/Backward and the per-part tags, < 2^16).
VIEW_TAG = 1 << 20


def group_members(group, timeout_s=None):
    """Global ranks of `group`'s members in group-rank order (collective;
    with timeout_s, TimeoutError naming the group when a member does not
    answer within it, rather than the process group's own default of 30
    minutes)."""
    size = dist.get_world_size(group)
    me = torch.tensor([dist.get_rank()], dtype=torch.int64)
    out = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    work = dist.all_gather(out, me, group=group, async_op=True)
    what = f"rank {dist.get_rank()}: gathering the members of a group of {size}"
    try:
        done = work.wait() if timeout_s is None else \
            work.wait(timeout=datetime.timedelta(seconds=float(timeout_s)))
    except RuntimeError as e:
        text = str(e)
        if "timed out" in text.lower() or "timeout" in text.lower():
            raise TimeoutError(f"{what}: no answer within {timeout_s:g} s ({text})") from None
        raise RuntimeError(f"{what} failed: {text}") from None
    if done is False:
        raise TimeoutError(f"{what}: no answer within {timeout_s:g} s")
    return [int(t.item()) for t in out]


try:
    from torch.distributed.device_mesh import DeviceMesh as _DeviceMesh
except ImportError:  # torch without DeviceMesh (1.13)
    _DeviceMesh = None


def is_device_mesh(group):
    return _DeviceMesh is not None and isinstance(group, _DeviceMesh)


def as_process_group(group, what="group"):
    """group itself, or the ProcessGroup of a DeviceMesh that has one
    dimension (a 1-D mesh, or one dimension of an n-D mesh: mesh["cp"]).
    ValueError naming `what` for an n-D mesh, whose dimension must be chosen."""
    if not is_device_mesh(group):
        return group
    if group.ndim != 1:
        names = group.mesh_dim_names
        hint = (f"pass one dimension of it by name, e.g. mesh[{names[-1]!r}] (its dimensions: "
                f"{list(names)})" if names else "build it with mesh_dim_names and pass one "
                "dimension by name, e.g. mesh['cp']")
        raise ValueError(f"{what} is a {group.ndim}-D DeviceMesh of shape "
                         f"{tuple(group.shape)}, expected a 1-D one (the context-parallel "
                         f"ranks): {hint}")
    return group.get_group()


def check_group(group):
    """ValueError unless torch.distributed is initialised and `group` (None:
    the default group) is a live process group this process belongs to: a
    group destroyed by destroy_process_group, or one from an earlier
    init_process_group, is refused (it would otherwise run on stale
    connections, or not at all)."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("torch.distributed is not initialised: call "
                         "torch.distributed.init_process_group first (or, for kda, omit group "
                         "to run one process)")
    if group is None:
        return
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"group={group!r}, expected a torch.distributed ProcessGroup")
    try:
        rank = dist.get_rank(group)
    except (RuntimeError, ValueError) as e:  # torch 1.13 raises RuntimeError, 2.x ValueError
        raise ValueError(f"group {group!r} is not a live process group (destroyed by "
                         "destroy_process_group, or created before the current "
                         f"init_process_group): {e}") from None
    if rank < 0:
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of "
                         f"group {group!r}")


def _tensor(buf):
    """A C++ buffer as a torch tensor: a normal one even under
    torch.inference_mode() (torch 1.13's gloo writes received data in place
    on its own thread, where an inference tensor refuses it)."""
    if isinstance(buf, torch.Tensor):
        return buf
    with torch.inference_mode(False):
        return from_dlpack(buf)


class GroupBackend:
    """One rank's handle of a kdacp communicator over a torch group.

    group:       the torch ProcessGroup the messages travel on
    members:     global ranks of the communicator in its (chronological) order
    torch_order: global ranks in `group`'s rank order, or None for a view
                 (collectives then run as p2p between `members`)
    world_size:  the size of the kdacp world this communicator derives from
    """

    def __init__(self, group, members, torch_order, world_size, timeout_s, spans_world):
        self.group = group
        self.global_ranks = list(members)
        self.torch_order = None if torch_order is None else list(torch_order)
        self.world_size = int(world_size)
        self.timeout_s = float(timeout_s)
        self.timeout_ms = int(round(self.timeout_s * 1000))
        self.spans_world = bool(spans_world)
        self.rank = self.global_ranks.index(dist.get_rank())
        self.name = "torch." + str(dist.get_backend(group))
        self._timeout = datetime.timedelta(seconds=self.timeout_s)
        # all_gather_into_tensor (one flat output, no copies in and out of a
        # list) where the backend has it (gloo from torch 2.x, NCCL); None:
        # not tried yet.
        self._flat_gather = None if hasattr(dist, "all_gather_into_tensor") else False

    def with_timeout(self, timeout_s):
        """The same communicator with another timeout (no message)."""
        return GroupBackend(self.group, self.global_ranks, self.torch_order, self.world_size,
                            timeout_s, self.spans_world)

    @property
    def size(self):
        return len(self.global_ranks)

    # -- waiting ------------------------------------------------------------

    def _wait(self, work, what):
        try:
            done = work.wait(timeout=self._timeout)
        except RuntimeError as e:
            text = str(e)
            if "timed out" in text.lower() or "timeout" in text.lower():
                raise TimeoutError(f"{what}: no answer within {self.timeout_s:g} s ({text})") from None
            raise RuntimeError(f"{what} failed: {text}") from None
        if done is False:
            raise TimeoutError(f"{what}: no answer within {self.timeout_s:g} s")

    def wait(self, handle):
        work, what, staging, target = handle
        self._wait(work, what)
        if staging is not None:
            target.copy_(staging)

    def _who(self):
        return f"global ranks {self.global_ranks}"

    # -- collectives --------------------------------------------------------

    def all_gather(self, buf):
        flat = _tensor(buf)
        slots = flat.view(self.size, -1)
        if self.torch_order is None:
            self._view_all_gather(slots)
            return
        if self._flat_gather is not False and self.torch_order == self.global_ranks:
            try:
                work = dist.all_gather_into_tensor(flat, slots[self.rank], group=self.group,
                                                   async_op=True)
            except RuntimeError as e:
                # A backend without it says so locally, on every rank alike.
                if self._flat_gather is not None or "support" not in str(e):
                    raise
                self._flat_gather = False
            else:
                self._flat_gather = True
                self._wait(work, f"all_gather over {self._who()}")
                return
        outs = [slots[self.global_ranks.index(g)] for g in self.torch_order]
        work = dist.all_gather(outs, slots[self.rank], group=self.group, async_op=True)
        self._wait(work, f"all_gather over {self._who()}")

    def broadcast(self, buf, root):
        t = _tensor(buf)
        src = self.global_ranks[root]
        if self.torch_order is None:
            self._view_broadcast(t, root)
            return
        work = dist.broadcast(t, src=src, group=self.group, async_op=True)
        self._wait(work, f"broadcast from global rank {src} over {self._who()}")

    def barrier(self):
        if self.torch_order is None:
            self._view_all_gather(torch.zeros(self.size, 1, dtype=torch.uint8))
            return
        work = dist.barrier(group=self.group, async_op=True)
        self._wait(work, f"barrier over {self._who()}")

    # -- point to point -----------------------------------------------------

    def isend(self, buf, peer, tag):
        dst = self.global_ranks[peer]
        work = dist.isend(_tensor(buf), dst=dst, group=self.group, tag=tag)
        return work, f"send to global rank {dst} (tag {tag})", None, None

    def irecv(self, buf, peer, tag):
        # Received into a staging tensor that the Work keeps alive, copied out
        # after a successful wait: a message that arrives after kdacp gave up
        # (Timeout) lands there, never in a C++ buffer freed meanwhile.
        src = self.global_ranks[peer]
        target = _tensor(buf)
        with torch.inference_mode(False):
            staging = torch.empty_like(target)
        work = dist.irecv(staging, src=src, group=self.group, tag=tag)
        return work, f"receive from global rank {src} (tag {tag})", staging, target

    # -- a view's collectives, from p2p -------------------------------------

    def _view_all_gather(self, slots):
        pending = []
        for j, g in enumerate(self.global_ranks):
            if j == self.rank:
                continue
            pending.append(self.irecv(slots[j], j, VIEW_TAG))
            pending.append(self.isend(slots[self.rank], j, VIEW_TAG))
        for handle in pending:
            self.wait(handle)

    def _view_broadcast(self, t, root):
        if self.rank == root:
            pending = [self.isend(t, j, VIEW_TAG)
                       for j in range(self.size) if j != root]
        else:
            pending = [self.irecv(t, root, VIEW_TAG)]
        for handle in pending:
            self.wait(handle)

    # -- split --------------------------------------------------------------

    def split(self, color, key):
        table = torch.zeros(self.size, 2, dtype=torch.int64)
        table[self.rank] = torch.tensor([color, key], dtype=torch.int64)
        self.all_gather(table.view(torch.uint8).reshape(-1))
        colors = sorted({int(c) for c in table[:, 0] if c >= 0})
        groups = {}
        for c in colors:
            idx = [j for j in range(self.size) if table[j, 0] == c]
            idx.sort(key=lambda j: (int(table[j, 1]), j))
            groups[c] = [self.global_ranks[j] for j in idx]
        if self.spans_world and self.torch_order is not None:
            # Every process of the default group is here: create every
            # sub-group, in ascending color order, on every process.
            result = None
            for c in colors:
                ranks = sorted(groups[c])
                pg = dist.new_group(ranks=ranks, timeout=self._timeout)
                if c == color:
                    result = GroupBackend(pg, groups[c], ranks, self.world_size,
                                          self.timeout_s, spans_world=False)
            return result
        if color < 0:
            return None
        return GroupBackend(self.group, groups[color], None, self.world_size,
                            self.timeout_s, spans_world=False)


def backend_for(group, timeout_s):
    """The kdacp world communicator of `group` (None: the default group).

    Collective over the group (it gathers the members' global ranks). The
    kdacp world is the group itself: its splits are correct whether or not it
    spans the default group (see the module docstring).
    """
    group = as_process_group(group)
    check_group(group)
    g = dist.group.WORLD if group is None else group
    members = group_members(g, timeout_s)
    spans = len(members) == dist.get_world_size()
    return GroupBackend(g, members, members, len(members), timeout_s, spans)


_BACKENDS = {}


def group_backend(group, timeout_s):
    """One backend per (group, timeout), reused across calls, so the layers
    cached for it stay valid. Only the first call on a group is collective
    (it gathers the members, bounded by timeout_s); a new timeout on a known
    group reuses them, so ranks that pass different timeouts still meet in
    the agreement that names the difference. The group must be live
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


def reject(backend, what, error):
    """Raises `error`, this rank's own argument error, after one agreement
    that tells its peers (waiting in their call's agreement, in C++) so
    that they raise naming this rank instead of waiting for it."""
    try:
        _kdacp.reject_call(backend, what, str(error))
    except ValueError:
        pass  # the agreement's copy of `error`
    raise error
