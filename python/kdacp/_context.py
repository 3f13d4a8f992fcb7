"""The CP context of chunk_kda and causal_conv1d (build_cp_context,
CpContext): every cross-rank agreement, the layout and the backend done once
per batch; a call then sends only the exchange's messages."""

import copy

import torch
import torch.distributed as dist

from kdacp import _kdacp, _ops
from kdacp._autograd import cu_list
from kdacp._comm import as_process_group, check_group, group_backend, reject
from kdacp._cp_meta import equal_split_condition, fewer_tokens, fla_fields
from kdacp._common import (SINGLE_PROCESS, _group_size, _integer, _options, _threads, _timeout,
                           _ulysses)
from kdacp._layer import (_LAYOUTS, _KdaFunction, _check_arguments, _storage_dtypes, kda,
                          layer_forward)


_NO_TRANSFORMS = {"use_qk_l2norm_in_kernel": False, "use_gate_in_kernel": False,
                  "use_beta_sigmoid_in_kernel": False, "lower_bound": None,
                  "A_log given": False, "dt_bias given": False, "allow_neg_eigval": False}
_CALL_FIELDS = ("B", "H", "HV", "K", "V", "dtype", "storage dtypes q,k,v,g,beta", "scale",
                "algorithm", "deterministic", "keep_forward", "initial_state given",
                "output_final_state", "use_qk_l2norm_in_kernel", "use_gate_in_kernel",
                "use_beta_sigmoid_in_kernel", "lower_bound", "A_log given", "dt_bias given",
                "allow_neg_eigval")


def _as_list(t):
    return None if t is None else t.tolist()


class CpContext:
    """A context-parallel context (build_cp_context): every cross-rank
    agreement done once, the C++ Layout and the backend built once.

    flash-linear-attention's attributes (its FLACPContext's, with its
    meanings, for this rank): group; cu_seqlens and cu_seqlens_cpu (this
    rank's local boundaries, int32, on the input's device and on the CPU;
    None when built without cu_seqlens); layout ("contiguous" or "zigzag");
    conv1d_kernel_size; with a contiguous layout pre_num_ranks,
    post_num_ranks (how many ranks before/after this one hold tokens of this
    rank's first/last sequence), is_first_rank, is_last_rank,
    pre_num_conv_tokens (tokens of this rank's first sequence on earlier
    ranks); with zigzag those are None, as flash-linear-attention's, and
    part_len (None when the parts' lengths differ), front_num_seqs and the
    *_by_part pairs (front part, back part) hold them; pre_num_ranks_dev,
    post_num_ranks_dev (None); num_seqs, is_cp_enabled, copy_for_backward().
    Ranks are counted in parts (zigzag's 2P slots) as there; uneven splits
    count the ranks that hold the tokens.

    kdacp's: backend (the kdacp comm backend; None for a single process),
    global_layout (the global kdacp._kdacp.Layout), global_cu_seqlens (the
    global boundaries, a list of ints, or None), rank, world_size, split
    (tokens per rank), local_tokens, protocol, allgather_group_size, options
    (dict), timeout_s.
    """

    def __init__(self, group, backend, layout, layout_name, cu, split, conv1d_kernel_size,
                 protocol, width, options, timeout_s, rank=None, world_size=None, device=None,
                 metadata_only=False):
        self.group = group
        self.backend = backend
        self.global_layout = layout
        self.layout = layout_name
        self.rank = (0 if backend is None else backend.rank) if rank is None else rank
        self.world_size = ((1 if backend is None else backend.size) if world_size is None
                           else world_size)
        self.global_cu_seqlens = cu
        self.split = split
        self.conv1d_kernel_size = conv1d_kernel_size
        self.protocol = protocol
        self.allgather_group_size = width
        self.options = options
        self.timeout_s = timeout_s
        self.__dict__.update(fla_fields(layout, layout_name, self.rank, cu,
                                        device or torch.device("cpu")))
        self.pre_num_ranks_dev = self.post_num_ranks_dev = None
        # get_cp_cu_seqlens with world_size and rank: metadata, no group to run on
        self._metadata_only = metadata_only
        self._layers = {}
        self._signature = None  # the per-call arguments the ranks agreed on at the first call
        _ops.register_context(self, -1 if cu is None else len(cu) - 1)  # torch.compile's key

    @property
    def num_seqs(self):
        """flash-linear-attention's: the number of sequences on this rank."""
        return 0 if self.cu_seqlens is None else len(self.cu_seqlens) - 1

    @property
    def is_cp_enabled(self):
        """flash-linear-attention's: whether a process group is attached."""
        return self.backend is not None

    def copy_for_backward(self):
        """flash-linear-attention's: a copy with its own boundary tensors (the
        layers and the first call's agreement stay shared)."""
        other = copy.copy(self)
        for name in ("cu_seqlens", "cu_seqlens_cpu"):
            if getattr(self, name) is not None:
                setattr(other, name, getattr(self, name).clone())
        _ops.register_context(other, self._op_sequences)  # its own key under torch.compile
        return other

    def _check_runnable(self, what):
        if self._metadata_only:
            raise ValueError(f"{what}: this cp_context comes from get_cp_cu_seqlens with "
                             f"world_size and rank (metadata only, no process group): build one "
                             f"with build_cp_context(cu_seqlens, group) to run on it")

    def __repr__(self):
        return (f"<kdacp CpContext rank {self.rank}/{self.world_size} {self.layout} "
                f"{self.global_layout} protocol {self.protocol}>")

    @property
    def local_tokens(self):
        return self.global_layout.local_tokens(self.rank)

    def _call_row(self, shape, dtype, storage, scale, algorithm, deterministic, keep_forward,
                  h0_given, want_ht, signature):
        b, _, h, hv, kd, vd = shape
        row = {"B": b, "H": h, "HV": hv, "K": kd, "V": vd, "dtype": dtype,
               "storage dtypes q,k,v,g,beta": storage, "scale": scale,
               "algorithm": algorithm, "deterministic": deterministic,
               "keep_forward": keep_forward,
               "initial_state given": h0_given,
               "output_final_state": want_ht}
        row.update(signature)
        return row

    def matches_cu_seqlens(self, cu_seqlens):
        """Whether a call's cu_seqlens may come with this context: None, the
        global boundaries it was built from, or this rank's local ones
        (cu_seqlens, as flash-linear-attention's callers pass)."""
        if cu_seqlens is None:
            return True
        given = cu_list(cu_seqlens)
        local = _as_list(self.cu_seqlens_cpu)
        return given == self.global_cu_seqlens or (local is not None and given == local)

    def _check_cu_seqlens(self, cu_seqlens):
        """A call's cu_seqlens must be None, the context's global ones (its
        layout and cuts were built from them) or its local ones."""
        if not self.matches_cu_seqlens(cu_seqlens):
            raise ValueError(f"rank {self.rank}: cu_seqlens {cu_list(cu_seqlens)} differs from its "
                             f"cp_context's (global {self.global_cu_seqlens}, this rank's local "
                             f"{_as_list(self.cu_seqlens_cpu)}): pass None or one of them")

    def _kda(self, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
             algorithm, keep_forward, signature, deterministic, want_incoming=False):
        """kda over the context's layout (want_incoming, in inference mode:
        outside autograd, also returning the state entering each of this
        rank's parts, _parts' order). Only the first call sends an
        agreement (of the per-call arguments, deterministic among them);
        later calls compare theirs with it locally and send nothing but the
        exchange."""
        self._check_runnable("chunk_kda")
        if self.backend is None:
            self._check_cu_seqlens(cu_seqlens)
            out = kda(q, k, v, g, beta, scale, initial_state, output_final_state,
                      self.global_cu_seqlens,
                      algorithm=algorithm, keep_forward=keep_forward,
                      deterministic=deterministic,
                      allow_neg_eigval=signature["allow_neg_eigval"], **self.options)
            return (*out, [None]) if want_incoming else out  # one part: every sequence starts
        error = None
        row = None
        try:
            # Inside: the error travels in the first call's agreement.
            self._check_cu_seqlens(cu_seqlens)
            shape, cu, scale, threads, tensors, h0, dtype = _check_arguments(
                q, k, v, g, beta, scale, initial_state, output_final_state,
                self.global_cu_seqlens, self.layout, algorithm, keep_forward, self.options, deterministic,
                signature["allow_neg_eigval"])
            want = self.local_tokens
            if shape[1] != want:
                raise ValueError(f"rank {dist.get_rank()}: q has {shape[1]} tokens, expected "
                                 f"{want}: this rank's part of the cp_context's layout "
                                 f"{self.global_layout}")
            row = self._call_row(shape, dtype, _storage_dtypes(q, k, v, g, beta), scale,
                                 algorithm, deterministic, keep_forward, h0 is not None,
                                 output_final_state, signature)
        except (ValueError, TypeError) as e:
            error = e
        if error is not None:
            if self._signature is None:
                # The peers are in the first call's agreement (the layer's
                # construction, in C++): they fail with this rank's error.
                reject(self.backend, "chunk_kda (first call on its cp_context)", error)
            raise error
        if self._signature is not None and row != self._signature:
            diffs = [f"{n}={row[n]!r} (agreed at the first call: {self._signature[n]!r})"
                     for n in _CALL_FIELDS if row[n] != self._signature[n]]
            raise ValueError(
                f"rank {dist.get_rank()}: chunk_kda on a cp_context called with other "
                f"arguments than at its first call, where every rank agreed on them: "
                f"{'; '.join(diffs)}; nothing was sent (its peers wait for it until the "
                f"timeout); build a new context for other arguments")
        layer = self._layers.get(dtype)
        if layer is None:
            # One C++ layer per config (shapes, storage) inside; it weighs
            # this batch's cuts (auto, pipelined_p2p's segments) and chooses
            # ulysses="auto"'s width.
            layer = _kdacp.KdaLayer(self.backend, self.protocol, int(self.allgather_group_size),
                                    self.global_layout, dtype, _options(self.options),
                                    threads, _ulysses(self.options), self.layout)
            # Its first forward and backward agree on the call's arguments (and
            # its construction on the config); later calls are held to the
            # first one's here, locally, and send only the exchange's messages.
            layer.agree_per_call(False)
            self._layers[dtype] = layer
        layer.transforms(signature["use_qk_l2norm_in_kernel"], signature["use_gate_in_kernel"],
                         signature["lower_bound"], signature["A_log given"],
                         signature["dt_bias given"], signature["use_beta_sigmoid_in_kernel"],
                         signature["allow_neg_eigval"])
        if want_incoming:  # inference mode (return_intermediate_states): no autograd
            o, ht, saved = layer_forward(layer, list(shape), scale, cu, output_final_state,
                                         algorithm, keep_forward, deterministic, tensors, h0)
            try:  # every rank ran the same forward and fails alike here
                incoming = [torch.from_numpy(x) for x in saved.incoming()]
            except ValueError as e:
                raise NotImplementedError(f"chunk_kda: return_intermediate_states=True on a "
                                          f"Ulysses layer: {e}") from None
        else:
            o, ht = _KdaFunction.apply(layer, list(shape), scale, cu, output_final_state,
                                       algorithm, keep_forward, deterministic, *tensors, h0)
        if self._signature is None:
            self._signature = row  # every rank agreed on it (C++), the call ran
        ht = ht if output_final_state else None
        return (o, ht, incoming) if want_incoming else (o, ht)

    def _parts(self):
        """This rank's parts in chain order: (first, end) global token
        indices, as its inputs hold them."""
        return [tuple(p) for p in self.global_layout.local_parts(self.rank)]


def build_cp_context(cu_seqlens, group, conv1d_kernel_size=None, cu_seqlens_cpu=None,
                     use_tf32x3_affine_chain=True, layout="contiguous", *, split=None,
                     protocol="auto", allgather_group_size=1, **options):
    """A CpContext for chunk_kda(..., cp_context=ctx), built once per batch:
    flash-linear-attention's build_cp_context, its parameters in its order
    and with its defaults, kdacp's extras after them as keywords. Collective
    over `group` (one agreement; plus the group's first gather the first time
    kdacp meets it).

    cu_seqlens: the global boundaries (1-D int tensor or ints; None: B
    sequences, one per batch row, then `split` is required). group: a live
    torch.distributed group (its ranks in order are the CP order), or
    SINGLE_PROCESS. cu_seqlens_cpu: the same boundaries on the CPU (used when
    cu_seqlens is None; ValueError when both are given and differ).
    use_tf32x3_affine_chain: must not be False (ValueError, as there; kdacp
    computes in float32/float64 on the CPU). layout: "contiguous" (rank r
    holds the r-th run of tokens) or "zigzag". split: None (flash-linear-
    attention's equal split: T/P tokens per rank, T/(2P) per zigzag part; a
    T not divisible by them is its ValueError), "balanced" (kdacp's: the
    first T mod P ranks, or parts with zigzag, one token more, as the CLI's
    default) or tokens per rank for a contiguous layout (any lengths; with
    zigzag, zigzag's own counts). protocol, allgather_group_size and
    options as build_kda_state_cp, plus ulysses (U or "auto", as kda's:
    Ulysses x state CP over head groups of U ranks). Checked at build, in the agreement: the
    layout, world size, cu_seqlens, split, conv1d_kernel_size, protocol,
    allgather_group_size, options and timeout. Checked at the first chunk_kda
    call (its one agreement): B, H, HV, K, V, dtype, scale, algorithm,
    deterministic, the flags and which of initial_state, A_log, dt_bias are
    given (deterministic is per call, as algorithm: chunk_kda's and kda's
    keyword, the layout's cuts checked against its 64-token rule at that
    call when algorithm is "chunk"); later calls
    must pass the same (a rank that does not raises ValueError before sending;
    its peers time out naming it) and send only the exchange's messages.
    Fewer tokens than ranks (than 2P with zigzag) is a ValueError naming
    flash-linear-attention's condition and kdacp's.
    """
    _check_tf32(use_tf32x3_affine_chain)
    cu_seqlens = _one_cu(cu_seqlens, cu_seqlens_cpu)
    if layout not in _LAYOUTS:
        raise ValueError(f"layout {layout!r}, expected 'contiguous' or 'zigzag'")
    if conv1d_kernel_size is not None:
        conv1d_kernel_size = _integer(conv1d_kernel_size, "conv1d_kernel_size", 1, 1 << 16)
    cu = None
    if cu_seqlens is not None:
        cu = cu_list(cu_seqlens)  # its values are checked with the layout, in C++
    options = dict(options)
    _options(options)
    timeout_s = _timeout(options)
    _threads(options)
    if not isinstance(protocol, str) or protocol not in _kdacp.exchange_methods():
        raise ValueError(f"unknown protocol {protocol!r}, expected one of "
                         f"{_kdacp.exchange_methods()}")
    width = _group_size(allgather_group_size)
    if group is SINGLE_PROCESS:
        world, backend = 1, None
    else:
        if group is None:
            raise ValueError("build_cp_context: group=None, expected a process group "
                             "(torch.distributed.group.WORLD or a new_group), or "
                             "kdacp.torch.SINGLE_PROCESS for one process")
        group = as_process_group(group, "build_cp_context: group")
        check_group(group)
        backend = group_backend(group, timeout_s)
        world = backend.size
    # Arguments converted here; their checks, the layout and the ranks'
    # agreement are C++'s (agree_layer_context). A conversion error travels
    # in that agreement, so the other ranks raise too instead of waiting.
    error = ""
    tokens, counts, opts, width_u = 0, [], None, 1
    try:
        if split is None and cu is not None:
            condition = equal_split_condition(max(cu[-1], 0), world, layout)
            if condition is not None:
                raise ValueError(condition)
        if isinstance(split, str):
            if split != "balanced":
                raise ValueError(f"split={split!r}, expected None, 'balanced' or tokens per "
                                 f"rank")
        elif split is not None:
            if isinstance(split, torch.Tensor):
                split = split.tolist()
            counts = [_integer(x, "split", 0, 1 << 62) for x in split]
        if cu is None and split is None:
            raise ValueError("cu_seqlens=None and split=None: pass split (tokens per rank), "
                             "the layout cannot be known otherwise")
        tokens = max(cu[-1], 0) if cu else sum(counts)
        opts = _options(options)
        width_u = _ulysses(options)
    except (ValueError, TypeError) as e:
        error = str(e)
        opts = opts if opts is not None else _options({})
    try:
        built = _kdacp.agree_context(backend, tokens, cu, layout, counts, protocol, width, opts,
                                     width_u, conv1d_kernel_size, error)  # naming the setting
    except ValueError as e:
        raise _with_condition(e, tokens, world, layout, split) from None
    split = [built.local_tokens(r) for r in range(world)]
    return CpContext(group, backend, built, layout, cu, split, conv1d_kernel_size, protocol,
                     width, options, timeout_s, device=_device(cu_seqlens))


def _check_tf32(use_tf32x3_affine_chain):
    if use_tf32x3_affine_chain is False:
        raise ValueError("use_tf32x3_affine_chain=False: flash-linear-attention no longer "
                         "supports it; kdacp computes in float32/float64 on the CPU")


def _one_cu(cu_seqlens, cu_seqlens_cpu):
    """cu_seqlens, or cu_seqlens_cpu when it is None; ValueError when both
    are given and differ."""
    if cu_seqlens is None:
        return cu_seqlens_cpu
    if cu_seqlens_cpu is not None and cu_list(cu_seqlens) != cu_list(cu_seqlens_cpu):
        raise ValueError(f"cu_seqlens {cu_list(cu_seqlens)} and cu_seqlens_cpu "
                         f"{cu_list(cu_seqlens_cpu)} differ, expected the same boundaries")
    return cu_seqlens


def _device(cu_seqlens):
    return cu_seqlens.device if isinstance(cu_seqlens, torch.Tensor) else torch.device("cpu")


def _with_condition(error, tokens, world, layout, split):
    """kdacp's error, led by flash-linear-attention's condition when there are
    fewer tokens than ranks (an equal or balanced split; an explicit split
    names its own counts)."""
    if "`total_tokens`" in str(error):  # flash-linear-attention's condition already
        return error
    condition = fewer_tokens(tokens, world, layout) if split in (None, "balanced") else None
    return error if condition is None else ValueError(f"{condition} {error}")


def get_cp_cu_seqlens(cu_seqlens, cu_seqlens_cpu=None, world_size=None, rank=None, group=None,
                      conv1d_kernel_size=None, use_tf32x3_affine_chain=True,
                      layout="contiguous", **kwargs):
    """flash-linear-attention's get_cp_cu_seqlens: rank `rank`'s CpContext
    for a world of `world_size` ranks over the global boundaries.

    world_size None: `group`'s size and rank, and the result is
    build_cp_context(cu_seqlens, group, ...) (collective; kwargs are its
    kdacp extras). world_size and rank given: computed locally, no
    communication, flash-linear-attention's equal split (its ValueError for a
    T not divisible by the parts) or, with the keyword split="balanced",
    kdacp's (the first T mod P ranks, or parts with zigzag, one token more);
    the result carries the attributes only: chunk_kda and causal_conv1d
    refuse it (ValueError). Other kwargs there: TypeError, as there.
    """
    _check_tf32(use_tf32x3_affine_chain)
    if layout not in _LAYOUTS:
        raise ValueError(f"layout {layout!r}, expected 'contiguous' or 'zigzag'")
    if world_size is None:
        if group is None:
            raise ValueError("get_cp_cu_seqlens: world_size=None and group=None, expected a "
                             "process group or world_size and rank")
        return build_cp_context(cu_seqlens, group, conv1d_kernel_size, cu_seqlens_cpu,
                                use_tf32x3_affine_chain, layout, **kwargs)
    split = kwargs.pop("split", None)
    if split not in (None, "balanced"):
        raise ValueError(f"get_cp_cu_seqlens: split={split!r}, expected None or 'balanced' "
                         f"(tokens per rank need a group: build_cp_context)")
    if kwargs:
        raise TypeError(f"get_cp_cu_seqlens() got unexpected keyword argument(s) "
                        f"{sorted(kwargs)} (kdacp's extras need a group: build_cp_context)")
    world = _integer(world_size, "world_size", 1, 1 << 30)
    if rank is None or not 0 <= _integer(rank, "rank", 0, 1 << 30) < world:
        raise ValueError(f"get_cp_cu_seqlens: rank={rank!r}, expected 0 <= rank < "
                         f"world_size = {world}")
    if conv1d_kernel_size is not None:
        conv1d_kernel_size = _integer(conv1d_kernel_size, "conv1d_kernel_size", 1, 1 << 16)
    source = _one_cu(cu_seqlens, cu_seqlens_cpu)
    if source is None:
        raise ValueError("get_cp_cu_seqlens: cu_seqlens=None, expected the global boundaries")
    cu = cu_list(source)
    tokens = max(cu[-1], 0)
    condition = equal_split_condition(tokens, world, layout) if split is None else None
    if condition is not None:
        raise ValueError(condition)
    try:
        built = (_kdacp.Layout.contiguous(tokens, world) if layout == "contiguous"
                 else _kdacp.Layout.zigzag(tokens, world))
        built.cuts(cu)  # the boundaries' checks (C++'s, as build_cp_context's)
    except ValueError as e:
        raise _with_condition(e, tokens, world, layout, split) from None
    split = [built.local_tokens(r) for r in range(world)]
    return CpContext(group, None, built, layout, cu, split, conv1d_kernel_size, "auto", 1, {},
                     None, rank=int(rank), world_size=world, device=_device(source),
                     metadata_only=True)
