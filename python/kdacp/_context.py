"""The CP context of chunk_kda and causal_conv1d (build_cp_context,
CpContext): every cross-rank agreement, the layout and the backend done once
per batch; a call then sends only the exchange's messages."""

import torch
import torch.distributed as dist

from kdacp import _kdacp
from kdacp._autograd import cu_list
from kdacp._comm import check_group, group_backend, reject
from kdacp._common import (SINGLE_PROCESS, _group_size, _integer, _options, _threads, _timeout,
                           _ulysses)
from kdacp._layer import _LAYOUTS, _KdaFunction, _check_arguments, _storage_dtypes, kda


_NO_TRANSFORMS = {"use_qk_l2norm_in_kernel": False, "use_gate_in_kernel": False,
                  "use_beta_sigmoid_in_kernel": False, "lower_bound": None,
                  "A_log given": False, "dt_bias given": False}
_CALL_FIELDS = ("B", "H", "HV", "K", "V", "dtype", "storage dtypes q,k,v,g,beta", "scale",
                "algorithm", "deterministic", "keep_forward", "initial_state given",
                "output_final_state", "use_qk_l2norm_in_kernel", "use_gate_in_kernel",
                "use_beta_sigmoid_in_kernel", "lower_bound", "A_log given", "dt_bias given")


class CpContext:
    """A context-parallel context (build_cp_context): every cross-rank
    agreement done once, the C++ Layout and the backend built once.

    Attributes: group, backend (the kdacp comm backend; None for a single
    process), layout (the global kdacp._kdacp.Layout), layout_name
    ("contiguous" or "zigzag"), rank, world_size, cu_seqlens (global list of
    ints, or None), split (tokens per rank), conv1d_kernel_size (int or
    None), protocol, allgather_group_size, options (dict), timeout_s.
    """

    def __init__(self, group, backend, layout, layout_name, cu, split, conv1d_kernel_size,
                 protocol, width, options, timeout_s):
        self.group = group
        self.backend = backend
        self.layout = layout
        self.layout_name = layout_name
        self.rank = 0 if backend is None else backend.rank
        self.world_size = 1 if backend is None else backend.size
        self.cu_seqlens = cu
        self.split = split
        self.conv1d_kernel_size = conv1d_kernel_size
        self.protocol = protocol
        self.allgather_group_size = width
        self.options = options
        self.timeout_s = timeout_s
        self._layers = {}
        self._signature = None  # the per-call arguments the ranks agreed on at the first call

    def __repr__(self):
        return (f"<kdacp CpContext rank {self.rank}/{self.world_size} {self.layout_name} "
                f"{self.layout} protocol {self.protocol}>")

    @property
    def local_tokens(self):
        return self.layout.local_tokens(self.rank)

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

    def _check_cu_seqlens(self, cu_seqlens):
        """A call's cu_seqlens must be None or the context's (its layout and
        cuts were built from them)."""
        if cu_seqlens is not None and cu_list(cu_seqlens) != self.cu_seqlens:
            raise ValueError(f"rank {self.rank}: cu_seqlens {cu_list(cu_seqlens)} differs from its "
                             f"cp_context's {self.cu_seqlens} (pass None or the same)")

    def _kda(self, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
             algorithm, keep_forward, signature, deterministic):
        """kda over the context's layout. Only the first call sends an
        agreement (of the per-call arguments, deterministic among them);
        later calls compare theirs with it locally and send nothing but the
        exchange."""
        if self.backend is None:
            self._check_cu_seqlens(cu_seqlens)
            return kda(q, k, v, g, beta, scale, initial_state, output_final_state, self.cu_seqlens,
                       algorithm=algorithm, keep_forward=keep_forward,
                       deterministic=deterministic, **self.options)
        error = None
        row = None
        try:
            # Inside: the error travels in the first call's agreement.
            self._check_cu_seqlens(cu_seqlens)
            shape, cu, scale, threads, tensors, h0, dtype = _check_arguments(
                q, k, v, g, beta, scale, initial_state, output_final_state, self.cu_seqlens,
                self.layout_name, algorithm, keep_forward, self.options, deterministic)
            want = self.local_tokens
            if shape[1] != want:
                raise ValueError(f"rank {dist.get_rank()}: q has {shape[1]} tokens, expected "
                                 f"{want}: this rank's part of the cp_context's layout "
                                 f"{self.layout}")
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
                                    self.layout, dtype, _options(self.options), threads,
                                    _ulysses(self.options), self.layout_name)
            # Its first forward and backward agree on the call's arguments (and
            # its construction on the config); later calls are held to the
            # first one's here, locally, and send only the exchange's messages.
            layer.agree_per_call(False)
            self._layers[dtype] = layer
        layer.transforms(signature["use_qk_l2norm_in_kernel"], signature["use_gate_in_kernel"],
                         signature["lower_bound"], signature["A_log given"],
                         signature["dt_bias given"], signature["use_beta_sigmoid_in_kernel"])
        o, ht = _KdaFunction.apply(layer, list(shape), scale, cu, output_final_state, algorithm,
                                   keep_forward, deterministic, *tensors, h0)
        if self._signature is None:
            self._signature = row  # every rank agreed on it (C++), the call ran
        return o, (ht if output_final_state else None)


def build_cp_context(cu_seqlens, group, conv1d_kernel_size=None, layout="contiguous", split=None,
                     protocol="auto", allgather_group_size=1, **options):
    """A CpContext for chunk_kda(..., cp_context=ctx), built once per batch
    (flash-linear-attention's build_cp_context; kdacp's extras after its
    arguments). Collective over `group` (one agreement; plus the group's
    first gather the first time kdacp meets it).

    cu_seqlens: the global boundaries (1-D int tensor or ints; None: B
    sequences, one per batch row, then `split` is required). group: a live
    torch.distributed group (its ranks in order are the CP order), or
    SINGLE_PROCESS. layout: "contiguous" (rank r holds the r-th run of
    tokens) or "zigzag". split: tokens per rank for a contiguous layout (any
    lengths; None: the first T mod P ranks ceil(T/P) tokens, the others
    floor(T/P), as the CLI's default); with
    zigzag None or zigzag's own counts. protocol, allgather_group_size and
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
    """
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
        check_group(group)
        backend = group_backend(group, timeout_s)
        world = backend.size
    # Arguments converted here; their checks, the layout and the ranks'
    # agreement are C++'s (agree_layer_context). A conversion error travels
    # in that agreement, so the other ranks raise too instead of waiting.
    error = ""
    tokens, counts, opts, width_u = 0, [], None, 1
    try:
        if split is not None:
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
    built = _kdacp.agree_context(backend, tokens, cu, layout, counts, protocol, width, opts,
                                 width_u, conv1d_kernel_size, error)  # ValueError naming the setting
    split = [built.local_tokens(r) for r in range(world)]
    return CpContext(group, backend, built, layout, cu, split, conv1d_kernel_size, protocol,
                     width, options, timeout_s)
