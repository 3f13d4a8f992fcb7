"""flash-linear-attention's own layers and models on kdacp (docs/fla-models.md):
use_with_fla() rebinds the names fla's KDA layer, short convolution, norms and
gated MLP call at run time to kdacp's CPU implementations, reversibly.

    fla_on_kdacp = kt.use_with_fla()            # or: with kt.use_with_fla(): ...
    with fla_on_kdacp.cp(ctx):                  # ctx = kt.build_cp_context(...)
        loss = loss_of(model(input_ids=local_ids))
    loss.backward()
    fla_on_kdacp.restore()
"""

import contextlib
import importlib
import threading

import torch
import torch.nn.functional as F

from kdacp._chunk import chunk_kda
from kdacp._context import CpContext
from kdacp._conv import causal_conv1d
from kdacp._conv_update import causal_conv1d_update


# -- torch implementations of fla's Triton-only norms and activations ---------
# Each computes in float32 (float64 for float64 inputs) and returns the
# input's dtype, as fla's kernels do; autograd gives the gradients.

def _compute(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _residual_add(x, residual, residual_in_fp32):
    """(x + residual in compute precision, the residual stream fla returns
    with prenorm=True): residual's dtype when given, float32 with
    residual_in_fp32, else x itself."""
    c = _compute(x)
    xc = x.to(c)
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual has shape {list(residual.shape)}, expected x's "
                             f"{list(x.shape)}")
        xc = xc + residual.to(c)
        return xc, xc.to(residual.dtype)
    return xc, (xc.to(torch.float32) if residual_in_fp32 else x)


def _rms(xc, weight, bias, eps):
    y = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(xc.dtype)
    if bias is not None:
        y = y + bias.to(xc.dtype)
    return y


def rms_norm(x, weight, bias, residual=None, eps=1e-5, prenorm=False, residual_in_fp32=False):
    """fla.modules.norm.layernorm.rms_norm (fla's RMSNorm, fuse_norm=True):
    y = (x + residual) / sqrt(mean((x + residual)^2) + eps) * weight + bias;
    with prenorm=True returns (y, x + residual)."""
    xc, res_out = _residual_add(x, residual, residual_in_fp32)
    y = _rms(xc, weight, bias, eps).to(x.dtype)
    return (y, res_out) if prenorm else y


def rms_norm_gated(x, g, weight, bias, activation="swish", residual=None, prenorm=False,
                   residual_in_fp32=False, eps=1e-6):
    """fla.modules.norm.fused_norm_gate.rms_norm_gated (FusedRMSNormGated,
    the KDA layer's o_norm): rms_norm's y times swish(g) = g·sigmoid(g)
    ("swish", "silu") or sigmoid(g) ("sigmoid")."""
    if activation not in ("swish", "silu", "sigmoid"):
        raise ValueError(f"rms_norm_gated: activation={activation!r}, expected 'swish', 'silu' "
                         "or 'sigmoid'")
    if g.shape != x.shape:
        raise ValueError(f"rms_norm_gated: g has shape {list(g.shape)}, expected x's "
                         f"{list(x.shape)}")
    xc, res_out = _residual_add(x, residual, residual_in_fp32)
    y = _rms(xc, weight, bias, eps)
    gc = g.to(xc.dtype)
    y = y * (torch.sigmoid(gc) if activation == "sigmoid" else F.silu(gc))
    y = y.to(x.dtype)
    return (y, res_out) if prenorm else y


def swiglu(x, y):
    """fla.modules.activations.swiglu: silu(x)·y."""
    c = _compute(x)
    return (F.silu(x.to(c)) * y.to(c)).to(x.dtype)


def swiglu_linear(x, y, weight, bias):
    """fla.modules.activations.swiglu_linear: linear(silu(x)·y, weight, bias)."""
    return F.linear(swiglu(x, y), weight, bias)


# -- the routed ops ------------------------------------------------------------

_LOCK = threading.RLock()
_STATE = {"originals": None, "handles": 0, "contexts": []}


def _ambient(cp_context):
    """An explicit cp_context wins; else the innermost FlaPatch.cp() block's."""
    if cp_context is not None:
        return cp_context
    contexts = _STATE["contexts"]
    return contexts[-1] if contexts else None


def _v_first(state, state_v_first):
    """fla's state_v_first stores a state [N,HV,V,K]; kdacp's is [N,HV,K,V]."""
    return state if state is None or not state_v_first else state.transpose(-1, -2)


def fla_chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  *args, state_v_first=False, cp_context=None, **kwargs):
    """fla.layers.kda's chunk_kda under use_with_fla(): kdacp.torch.chunk_kda
    with fla's state_v_first (the states' last two dims swapped) and the
    cp_context of the enclosing FlaPatch.cp() block when none is given."""
    o, ht = chunk_kda(q, k, v, g, beta, scale, _v_first(initial_state, state_v_first),
                      output_final_state, *args, cp_context=_ambient(cp_context), **kwargs)
    return o, _v_first(ht, state_v_first)


def fla_fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None,
                            initial_state=None, output_final_state=False,
                            use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                            use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                            lower_bound=None, state_v_first=False, cu_seqlens=None, **kwargs):
    """fla.layers.kda's fused_recurrent_kda under use_with_fla() (the layer's
    inference path: no grad, T <= 64 in eval mode). Inside a FlaPatch.cp()
    block (or given cp_context): kdacp's chunk_kda on that context (the same
    recurrence; fla's fused_recurrent_kda has no CP). Otherwise
    kdacp.torch.fused_recurrent_kda where this kdacp has it, else kdacp's
    chunk_kda."""
    import kdacp.torch as kt  # late: kdacp.torch imports this module
    ctx = _ambient(kwargs.pop("cp_context", None))
    own = getattr(kt, "fused_recurrent_kda", None)
    if own is not None and ctx is None:
        return own(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale,
                   initial_state=initial_state, output_final_state=output_final_state,
                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                   use_gate_in_kernel=use_gate_in_kernel,
                   use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                   allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound,
                   state_v_first=state_v_first, cu_seqlens=cu_seqlens, **kwargs)
    for name, value in (("A_log", A_log), ("dt_bias", dt_bias)):
        if not use_gate_in_kernel and value is not None:
            raise ValueError(f"fused_recurrent_kda: {name} given with use_gate_in_kernel=False")
    gate = {"A_log": A_log, "dt_bias": dt_bias} if use_gate_in_kernel else {}
    o, ht = chunk_kda(q, k, v, g, beta, scale, _v_first(initial_state, state_v_first),
                      output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                      use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound=lower_bound,
                      cu_seqlens=cu_seqlens, cp_context=ctx, **gate, **kwargs)
    return o, _v_first(ht, state_v_first)


def fla_causal_conv1d(x, weight=None, bias=None, residual=None, initial_state=None,
                      output_final_state=False, activation=None, backend="triton",
                      cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
                      cp_context=None, **kwargs):
    """fla.modules.causal_conv1d.ops.causal_conv1d (ShortConvolution's) under
    use_with_fla(): kdacp.torch.causal_conv1d with the enclosing
    FlaPatch.cp() block's cp_context when none is given."""
    return causal_conv1d(x, weight, bias, residual, initial_state, output_final_state,
                         activation, backend, cu_seqlens, cu_seqlens_cpu, chunk_indices,
                         _ambient(cp_context), **kwargs)


# (module, name, replacement): the names fla's code looks up when it runs.
ROUTES = (
    ("fla.layers.kda", "chunk_kda", fla_chunk_kda),
    ("fla.layers.kda", "fused_recurrent_kda", fla_fused_recurrent_kda),
    ("fla.modules.causal_conv1d.ops", "causal_conv1d", fla_causal_conv1d),
    ("fla.modules.causal_conv1d.ops", "causal_conv1d_update", causal_conv1d_update),
    ("fla.modules.norm.fused_norm_gate", "rms_norm_gated", rms_norm_gated),
    ("fla.modules.norm.layernorm", "rms_norm", rms_norm),
    ("fla.modules.mlp", "swiglu", swiglu),
    ("fla.modules.mlp", "swiglu_linear", swiglu_linear),
)


def _install():
    modules = {}
    for module, _, _ in ROUTES:
        try:
            modules[module] = importlib.import_module(module)
        except ImportError as e:
            raise ImportError(f"use_with_fla: flash-linear-attention's {module} is not "
                              f"importable ({e}); install flash-linear-attention 0.6 "
                              "(docs/fla-models.md)") from e
    missing = [f"{m}.{n}" for m, n, _ in ROUTES if not hasattr(modules[m], n)]
    if missing:
        raise RuntimeError(f"use_with_fla: this flash-linear-attention has no {missing}: its "
                           "layers do not call the names kdacp routes (tested with 0.6.0)")
    originals = {}
    for module, name, ours in ROUTES:
        originals[(module, name)] = getattr(modules[module], name)
        setattr(modules[module], name, ours)
    _STATE["originals"] = originals


def _uninstall():
    for (module, name), original in _STATE["originals"].items():
        mod = importlib.import_module(module)
        ours = next(r for m, n, r in ROUTES if (m, n) == (module, name))
        if getattr(mod, name) is ours:  # rebound by someone else since: theirs stays
            setattr(mod, name, original)
    _STATE["originals"] = None
    _STATE["contexts"].clear()


class FlaPatch:
    """The handle use_with_fla() returns: fla's layers run on kdacp until
    restore() (or the end of its with block). Handles nest: fla's names are
    rebound by the first live handle and given back when the last is
    restored."""

    def __init__(self):
        self._live = True

    @property
    def active(self):
        """Whether this handle still holds the routing (not yet restored)."""
        return self._live

    @staticmethod
    def routes():
        """The rebound names, 'module.name', in ROUTES order."""
        return [f"{m}.{n}" for m, n, _ in ROUTES]

    @contextlib.contextmanager
    def cp(self, cp_context):
        """Within the block, fla's KDA layers and short convolutions run under
        cp_context (kdacp.torch.build_cp_context): the model's input is this
        rank's tokens of its layout, every rank runs the same layers in the
        same order. Their backward needs no block (the context is kept by
        the forward). Blocks nest; None runs one process."""
        if not self._live:
            raise RuntimeError("FlaPatch.cp: this handle was restored; call "
                               "kdacp.torch.use_with_fla() again")
        if cp_context is not None and not isinstance(cp_context, CpContext):
            raise ValueError(f"FlaPatch.cp: cp_context is a {type(cp_context).__name__}, "
                             "expected a kdacp.torch.CpContext (build_cp_context) or None")
        with _LOCK:
            _STATE["contexts"].append(cp_context)
        try:
            yield cp_context
        finally:
            with _LOCK:
                if _STATE["contexts"]:  # emptied when the routing was given back inside
                    _STATE["contexts"].pop()

    def restore(self):
        """Gives fla's names back once the last live handle is restored (then
        fla runs its own kernels again). Idempotent per handle."""
        with _LOCK:
            if not self._live:
                return
            self._live = False
            _STATE["handles"] -= 1
            if _STATE["handles"] == 0:
                _uninstall()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.restore()

    def __repr__(self):
        state = "active" if self._live else "restored"
        return f"<kdacp FlaPatch {state}: {len(ROUTES)} flash-linear-attention names on kdacp>"


def use_with_fla():
    """Routes flash-linear-attention's KDA layer and model code to kdacp
    (docs/fla-models.md): rebinds, in fla's own modules, chunk_kda and
    fused_recurrent_kda of fla.layers.kda, ShortConvolution's causal_conv1d
    and causal_conv1d_update (single-token decoding), FusedRMSNormGated's rms_norm_gated, RMSNorm's rms_norm and GatedMLP's
    swiglu / swiglu_linear to kdacp's CPU implementations. fla's code is not
    edited; a layer built before or after the call runs on kdacp while a
    handle is live. Returns a FlaPatch (context manager; .cp(ctx) for CP;
    .restore()). Idempotent: a second call while one is live returns another
    handle on the same routing (the names are rebound once). ImportError
    when flash-linear-attention is not importable."""
    with _LOCK:
        if _STATE["handles"] == 0:
            _install()
        _STATE["handles"] += 1
        return FlaPatch()
