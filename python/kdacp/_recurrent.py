"""flash-linear-attention's fused_recurrent_kda and its decode entry
fused_recurrent_kda_fwd (continuous batching: ssm_state_indices,
num_accepted_tokens, inplace_final_state, out) on kdacp's recurrent
algorithm (the kda layer, token by token). docs/fla.md."""

import math

import torch

from kdacp import _kdacp
from kdacp._autograd import cu_list
from kdacp._chunk import (FlaAssertionError, _fla_keywords, _lower_bound, chunk_kda,
                          transform_inputs)
from kdacp._common import _DTYPES, _check_tensor, _compute_dtype, _from_numpy, _threads

__all__ = ["fused_recurrent_kda", "fused_recurrent_kda_fwd"]

_EXTRAS = ("algorithm", "threads", "deterministic")


def _check_extras(op, kwargs, allowed):
    unknown = sorted(n for n in kwargs if n not in allowed)
    if unknown:
        raise NotImplementedError(f"kdacp.torch.{op} does not support {unknown} (arguments kdacp "
                                  f"does not implement; supported extras: {list(allowed)})")


def _gate_needs_a_log(op, use_gate_in_kernel, A_log, lower_bound):
    if use_gate_in_kernel and A_log is None and lower_bound is None:
        raise ValueError(f"{op}: use_gate_in_kernel=True without A_log needs lower_bound (the "
                         "gate is then lower_bound·sigmoid(g + dt_bias)); flash-linear-attention "
                         "documents the same, its kernel would compute -e·softplus(g + dt_bias)")


def _columns(v, g, beta, a_log, dt_bias):
    """A beta per value column ([B,T,HV,V], flash-linear-attention's headwise
    beta): each column of the state then runs its own delta rule, so the
    call is the scalar-beta call on HV·V value heads of one column each
    (head j·V + c: value column c of head j, decay and gate of head j)."""
    b, t, hv, vd = v.shape
    kd = g.shape[3]
    g = g.unsqueeze(3).expand(b, t, hv, vd, kd).reshape(b, t, hv * vd, kd)
    if a_log is not None:
        a_log = a_log.reshape(hv).repeat_interleave(vd)
    if dt_bias is not None:
        dt_bias = dt_bias.reshape(hv, 1, kd).expand(hv, vd, kd).reshape(-1)
    return v.reshape(b, t, hv * vd, 1), g, beta.reshape(b, t, hv * vd), a_log, dt_bias


def _state_to_columns(s):  # [N,HV,K,V] -> [N,HV·V,K,1]
    return None if s is None else s.transpose(-1, -2).reshape(s.shape[0], -1, s.shape[2], 1)


def _state_from_columns(s, hv):  # [N,HV·V,K,1] -> [N,HV,K,V]
    return None if s is None else s.reshape(s.shape[0], hv, -1, s.shape[2]).transpose(-1, -2)


def _check_headwise(beta, v):
    if beta.dim() == 4 and tuple(beta.shape) != tuple(v.shape):
        raise ValueError(f"beta has shape {list(beta.shape)}, expected [B,T,HV] or v's "
                         f"{list(v.shape)} (a beta per value column)")
    return beta.dim() == 4


def fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None,
                        initial_state=None, output_final_state=False,
                        use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                        lower_bound=None, state_v_first=False, cu_seqlens=None, **kwargs):
    """flash-linear-attention's ``fla.ops.kda.fused_recurrent_kda`` on kdacp:
    chunk_kda's transforms and layer with algorithm="recurrent" (token by
    token). Returns (o [B,T,HV,V], final_state [N,HV,K,V] or None).
    beta [B,T,HV] or [B,T,HV,V] (one per value column). A_log [HV], dt_bias
    [HV·K]; with use_gate_in_kernel and no A_log, lower_bound is required
    (ValueError). Differentiable (once) w.r.t. every tensor (flash-linear-
    attention's is forward only). transpose_state_layout: the deprecated name
    of state_v_first (DeprecationWarning). Extras: algorithm, threads,
    deterministic."""
    state_v_first = _fla_keywords("fused_recurrent_kda", state_v_first, kwargs, chunk_size=False)
    if not isinstance(state_v_first, bool):
        raise ValueError(f"fused_recurrent_kda: state_v_first={state_v_first!r}, expected True or "
                         "False")
    _check_extras("fused_recurrent_kda", kwargs, _EXTRAS)
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("fused_recurrent_kda: allow_neg_eigval=True needs "
                         "use_beta_sigmoid_in_kernel=True (beta is then 2·sigmoid(beta))")
    _gate_needs_a_log("fused_recurrent_kda", use_gate_in_kernel, A_log, lower_bound)
    for t, name, nd in ((v, "v", 4), (g, "g", 4), (beta, "beta", None)):
        _check_tensor(t, name, nd)
    kwargs.setdefault("algorithm", "recurrent")
    gate = dict(A_log=A_log, dt_bias=dt_bias)
    if not _check_headwise(beta, v):
        return chunk_kda(q, k, v, g, beta, scale, initial_state, output_final_state,
                         use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                         allow_neg_eigval, False, lower_bound, False, False, state_v_first,
                         cu_seqlens, **gate, **kwargs)
    hv = v.shape[2]
    if initial_state is not None and state_v_first:
        initial_state = initial_state.transpose(-1, -2)
    v2, g2, beta2, a2, b2 = _columns(v, g, beta, A_log, dt_bias)
    gate = dict(A_log=a2, dt_bias=b2)
    o, ht = chunk_kda(q, k, v2, g2, beta2, scale, _state_to_columns(initial_state),
                      output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                      use_beta_sigmoid_in_kernel, allow_neg_eigval, False, lower_bound, False,
                      False, False, cu_seqlens, **gate, **kwargs)
    ht = _state_from_columns(ht, hv)
    if ht is not None:
        ht = (ht.transpose(-1, -2) if state_v_first else ht).contiguous()
    return o.reshape(v.shape), ht


def _transformed(q, k, v, g, beta, A_log, dt_bias, flags, lower_bound):
    """The decode path's inputs after the in-kernel transforms, contiguous in
    the compute dtype, checked as kda checks them (finite; g <= 0; beta in
    [0, 1], [0, 2] with allow_neg_eigval)."""
    for t, name, nd in ((q, "q", 4), (k, "k", 4), (v, "v", 4), (g, "g", 4)):
        _check_tensor(t, name, nd)
    _check_tensor(beta, "beta")
    compute = _compute_dtype(((q, "q"), (k, "k"), (v, "v"), (g, "g"), (beta, "beta")))
    q, k, g, beta = transform_inputs(q, k, g, beta, compute, flags, A_log, dt_bias, lower_bound)
    out = [x.to(compute).contiguous() for x in (q, k, v, g, beta)]
    for x, name, rule in zip(out, ("q", "k", "v", "g", "beta"),
                             ("finite", "finite", "finite", "gate",
                              "beta_neg_eigval" if flags[3] else "beta")):
        _kdacp.check_tensor(x.data_ptr(), list(x.shape), _DTYPES[compute], name, rule)
    return out, compute


def _slots(ssm_state_indices, num_accepted_tokens, lengths, pool, writes_in_pool):
    """(read slot per sequence, write slots per sequence) of continuous
    batching, checked: indices [N] (sequences of at most one token) or
    [N, S] (S >= each sequence's tokens), each in [0, pool) where a state
    is read or, writes_in_pool (in place), written; num_accepted_tokens [N]
    (with [N, S] indices): the state read is indices[n, accepted[n] - 1]."""
    idx = ssm_state_indices
    n = len(lengths)
    if not isinstance(idx, torch.Tensor) or idx.dtype.is_floating_point or idx.dim() not in (1, 2) \
            or idx.shape[0] != n:
        raise ValueError(f"ssm_state_indices must be an integer tensor [N] or [N, S] with N = {n} "
                         "sequences")
    rows = idx.tolist() if idx.dim() == 2 else [[x] for x in idx.tolist()]
    if num_accepted_tokens is not None:
        if idx.dim() != 2:
            raise ValueError("num_accepted_tokens needs ssm_state_indices of shape [N, S] (the "
                             "state read is indices[n, num_accepted_tokens[n] - 1])")
        acc = cu_list(num_accepted_tokens, "num_accepted_tokens")
        if len(acc) != n:
            raise ValueError(f"num_accepted_tokens has {len(acc)} entries, expected N = {n}")
        first = [a - 1 for a in acc]
    else:
        first = [0] * n
    reads, writes = [], []
    for i, (row, t_n, f) in enumerate(zip(rows, lengths, first)):
        if t_n == 0:  # flash-linear-attention skips it: nothing read or written
            reads.append(None)
            writes.append([])
            continue
        if t_n > len(row) or not 0 <= f < len(row):
            raise ValueError(f"ssm_state_indices row {i} has {len(row)} slots: sequence {i} has "
                             f"{t_n} tokens (a slot each) and reads slot entry {f}")
        for x in [row[f]] + (row[:t_n] if writes_in_pool else []):
            if not 0 <= x < pool:
                raise ValueError(f"ssm_state_indices row {i} holds slot {x}, expected one in "
                                 f"[0, {pool}) (the state pool's rows)")
        reads.append(row[f])
        writes.append(row[:t_n])
    return reads, writes


def fused_recurrent_kda_fwd(q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None,
                            scale=None, output_final_state=False, inplace_final_state=True,
                            state_v_first=False, cu_seqlens=None, ssm_state_indices=None,
                            num_accepted_tokens=None, use_qk_l2norm_in_kernel=False,
                            use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                            allow_neg_eigval=False, lower_bound=None, out=None, **kwargs):
    """flash-linear-attention's decode entry ``fused_recurrent_kda_fwd`` on
    kdacp (forward only, no autograd). Returns (out, final_state).
    inplace_final_state (default True): final_state is initial_state,
    updated in place. ssm_state_indices (continuous batching): the state
    of sequence n is read from initial_state[indices[n, i0]] (i0 =
    num_accepted_tokens[n] - 1, else 0) and the state after its token j
    written to final_state[indices[n, j]] (in place) or final_state[bos + j];
    zero-length sequences are skipped. out: written in place and returned."""
    op = "fused_recurrent_kda_fwd"
    _check_extras(op, kwargs, ("threads",))
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError(f"{op}: allow_neg_eigval=True needs use_beta_sigmoid_in_kernel=True")
    _gate_needs_a_log(op, use_gate_in_kernel, A_log, lower_bound)
    lower_bound = _lower_bound(lower_bound)
    for flag, name in ((output_final_state, "output_final_state"),
                       (inplace_final_state, "inplace_final_state"),
                       (state_v_first, "state_v_first")):
        if not isinstance(flag, bool):
            raise ValueError(f"{op}: {name}={flag!r}, expected True or False")
    _check_tensor(v, "v", 4)
    _check_tensor(beta, "beta")
    if out is not None and tuple(out.shape) != tuple(v.shape):
        raise FlaAssertionError(f"{op}: out has shape {list(out.shape)}, expected v's "
                                f"{list(v.shape)}")
    if inplace_final_state and initial_state is None:
        raise FlaAssertionError(f"{op}: inplace_final_state=True needs initial_state (the states "
                                "are written into it); pass inplace_final_state=False")
    with torch.no_grad():
        return _decode(q, k, v, g, beta, A_log, dt_bias, initial_state, scale,
                       output_final_state, inplace_final_state, state_v_first, cu_seqlens,
                       ssm_state_indices, num_accepted_tokens,
                       (use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                        allow_neg_eigval), lower_bound, out, kwargs)


def _decode(q, k, v, g, beta, A_log, dt_bias, initial_state, scale, output_final_state,
            inplace, state_v_first, cu_seqlens, indices, accepted, flags, lower_bound, out,
            kwargs):
    op = "fused_recurrent_kda_fwd"
    _check_tensor(q, "q", 4)
    headwise = _check_headwise(beta, v)
    b, t, hv, vd = v.shape
    v_dtype = v.dtype
    kd = q.shape[-1]
    state_shape = (hv, vd, kd) if state_v_first else (hv, kd, vd)
    if initial_state is not None:
        _check_tensor(initial_state, "initial_state", 4)
        if tuple(initial_state.shape[1:]) != state_shape:
            raise ValueError(f"{op}: initial_state has shape {list(initial_state.shape)}, "
                             f"expected [N, {', '.join(map(str, state_shape))}]")
    if headwise:
        v, g, beta, A_log, dt_bias = _columns(v, g, beta, A_log, dt_bias)
    (q, k, v2, g, beta), compute = _transformed(q, k, v, g, beta, A_log, dt_bias, flags,
                                                lower_bound)
    cu = None if cu_seqlens is None else cu_list(cu_seqlens, op)
    if cu is not None:
        if b != 1:
            raise ValueError(f"{op}: cu_seqlens with batch B = {b}, expected B = 1 (packed "
                             "sequences)")
        if len(cu) < 2 or cu[0] != 0 or any(y < x for x, y in zip(cu, cu[1:])) or cu[-1] > t:
            raise ValueError(f"{op}: cu_seqlens {cu}, expected non-decreasing from 0 to at most "
                             f"T = {t}")
        lengths = [y - x for x, y in zip(cu, cu[1:])]
        starts = cu[:-1]
    else:
        lengths, starts = [t] * b, [i * t for i in range(b)]
    n = len(lengths)
    if indices is None and initial_state is not None and initial_state.shape[0] != n:
        raise ValueError(f"{op}: initial_state has {initial_state.shape[0]} states, expected "
                         f"N = {n}")
    if indices is None and accepted is not None:
        raise ValueError(f"{op}: num_accepted_tokens needs ssm_state_indices")

    def to_kv(s):  # a state in the caller's layout -> [.., HV, K, V] in compute
        s = s.to(compute)
        s = s.transpose(-1, -2) if state_v_first else s
        return _state_to_columns(s) if headwise else s

    def from_kv(s):
        s = _state_from_columns(s, hv) if headwise else s
        return s.transpose(-1, -2) if state_v_first else s

    if indices is not None:
        pool = 0 if initial_state is None else initial_state.shape[0]
        reads, writes = _slots(indices, accepted, lengths,
                               pool if initial_state is not None else 1 << 62, inplace)
        if initial_state is not None:
            h0 = [initial_state[r] if r is not None else initial_state.new_zeros(state_shape)
                  for r in reads]
            h0 = to_kv(torch.stack(h0)).contiguous() if h0 else None
        else:
            h0 = None
    else:
        h0 = None if initial_state is None else to_kv(initial_state).contiguous()
    chunk = 1 if indices is not None else max(max(lengths), 1)
    o, states, finals = _kdacp.kda_chunk_states(
        q.data_ptr(), k.data_ptr(), v2.data_ptr(), g.data_ptr(), beta.data_ptr(),
        [b, t, q.shape[2], v2.shape[2], kd, v2.shape[3]],
        float(1.0 / math.sqrt(kd) if scale is None else scale), cu,
        0 if h0 is None else h0.data_ptr(), chunk, _DTYPES[compute], "recurrent",
        _threads(kwargs))
    o, states, finals = (_from_numpy(x) for x in (o, states, finals))
    o = o.reshape(b, t, hv, vd)
    covered = t if cu is None else cu[-1]
    if out is None:
        out = torch.zeros(b, t, hv, vd, dtype=v_dtype)
    _store(out[:, :covered], o[:, :covered], "out")
    final_state = _final_target(op, initial_state, inplace, output_final_state, indices, n,
                                covered, state_shape, compute)
    if final_state is None:
        return out, None
    if indices is None:
        _store(final_state, from_kv(finals), "final_state")
        return out, final_state
    after = states.clone()
    after[:-1] = states[1:]
    for i, (s, t_n) in enumerate(zip(starts, lengths)):
        if t_n:
            after[s + t_n - 1] = finals[i]
    after = from_kv(after)
    for i, (s, t_n) in enumerate(zip(starts, lengths)):
        for j in range(t_n):
            _store(final_state[writes[i][j] if inplace else s + j], after[s + j], "final_state")
    return out, final_state


def _store(dst, src, name):
    """dst ← src (rounded to dst's dtype); ValueError where a finite value
    overflows a 16-bit dst."""
    dst.copy_(src)
    if dst.dtype in (torch.float16, torch.bfloat16) and not torch.isfinite(dst).all():
        raise ValueError(f"fused_recurrent_kda_fwd: a value of {name} is beyond {dst.dtype}'s "
                         "range; use float32 or rescale")


def _final_target(op, initial_state, inplace, output_final_state, indices, n, covered,
                  state_shape, compute):
    """The tensor the states are written to (flash-linear-attention's rules):
    initial_state itself in place, else a new [N, ...] one when
    output_final_state, else none."""
    if inplace:
        return initial_state
    if not output_final_state:
        if indices is not None:
            raise ValueError(f"{op}: ssm_state_indices with inplace_final_state=False stores the "
                             "state after every token in final_state: pass "
                             "output_final_state=True")
        return None
    if indices is not None and covered > n:
        raise ValueError(f"{op}: ssm_state_indices with inplace_final_state=False stores the "
                         f"state after token i in final_state[i], which holds N = {n} states for "
                         f"{covered} tokens; pass inplace_final_state=True")
    return torch.zeros(n, *state_shape, dtype=compute)
