"""flash-linear-attention's own KDA layer (fla.layers.KimiDeltaAttention:
short convolutions, gate, norms) and a small fla model (KDAForCausalLM) on
kdacp through kdacp.torch.use_with_fla(): the routing and its undoing, the
torch norms against their FP64 formulas, the layer against the same layer on
fla's naive KDA ops and on FP64 references, decoding with a cache, and CP
over gloo (2 ranks contiguous, 4 zigzag) against one process.
Where flash-linear-attention is not importable (Debian's torch 1.13) only the\nnorms' formulas and use_with_fla's ImportError run."""

import pytest
import torch

import kdacp.torch as kt

from fla_layer_workers import (LAYER, cp_worker, install_references, layer_step,
                               make_layer, make_model)
from spawn_ranks import spawn

try:
    import fla.layers.kda  # noqa: F401
    HAVE_FLA = True
except ImportError:
    HAVE_FLA = False
needs_fla = pytest.mark.skipif(not HAVE_FLA, reason="flash-linear-attention is not importable")


@pytest.mark.skipif(HAVE_FLA, reason="flash-linear-attention is importable here")
def test_without_fla_use_with_fla_names_what_is_missing():
    for _ in range(2):  # a failed call leaves nothing behind
        with pytest.raises(ImportError, match=r"flash-linear-attention's fla\.\S+ is not "
                                              r"importable"):
            kt.use_with_fla()


@needs_fla
def test_routing_is_installed_nested_and_undone():
    import fla.modules.causal_conv1d.ops as conv_ops
    before = {r: getattr(__import__(m, fromlist=[n]), n) for m, n, _ in _routes()
              for r in [f"{m}.{n}"]}
    outer = kt.use_with_fla()
    inner = kt.use_with_fla()
    assert outer.active and inner.active and "fla.layers.kda.chunk_kda" in outer.routes()
    for m, n, ours in _routes():
        assert getattr(__import__(m, fromlist=[n]), n) is ours
    inner.restore()
    inner.restore()  # idempotent per handle
    assert not inner.active
    assert conv_ops.causal_conv1d is not before["fla.modules.causal_conv1d.ops.causal_conv1d"]
    with pytest.raises(RuntimeError, match="restored"):
        with inner.cp(None):
            pass
    with pytest.raises(ValueError, match="expected a kdacp.torch.CpContext"):
        with outer.cp("ctx"):
            pass
    outer.restore()
    for r, original in before.items():
        m, n = r.rsplit(".", 1)
        assert getattr(__import__(m, fromlist=[n]), n) is original, r
    with kt.use_with_fla() as handle:
        assert handle.active
    assert not handle.active and conv_ops.causal_conv1d is before[
        "fla.modules.causal_conv1d.ops.causal_conv1d"]


def _routes():
    from kdacp._fla import ROUTES
    return ROUTES


def _fp64_rms(x, w, eps, residual=None):
    x = x.double() + (0 if residual is None else residual.double())
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w.double(), x


@pytest.mark.parametrize("activation", ["swish", "sigmoid"])
def test_norms_and_swiglu_follow_their_formulas(activation):
    from kdacp import _fla
    gen = torch.Generator().manual_seed(3)
    xd, gd, res = (torch.randn(5, 7, 32, generator=gen, dtype=torch.float64) for _ in range(3))
    wd = 1 + 0.1 * torch.randn(32, generator=gen, dtype=torch.float64)
    x, g, w = (t.float().requires_grad_() for t in (xd, gd, wd))
    xd, gd, wd = (t.requires_grad_() for t in (xd, gd, wd))
    y = _fla.rms_norm_gated(x, g, w, None, activation, eps=1e-5)
    want, _ = _fp64_rms(xd, wd, 1e-5)
    want = want * (torch.sigmoid(gd) if activation == "sigmoid" else gd * torch.sigmoid(gd))
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-6)
    dy = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad((y * dy.float()).sum(), (x, g, w))
    exp = torch.autograd.grad((want * dy).sum(), (xd, gd, wd))
    for a, b in zip(got, exp):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)
    res = res.float()
    # RMSNorm with a residual, prenorm: (norm(x + residual), x + residual)
    y, r = _fla.rms_norm(x, w, None, residual=res, eps=1e-6, prenorm=True)
    want, summed = _fp64_rms(x.double(), wd.detach(), 1e-6, res)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(r.double(), summed, rtol=1e-6, atol=1e-6)
    assert _fla.rms_norm(x, w, None, prenorm=True, residual_in_fp32=True)[1].dtype == torch.float32
    h = x.half()
    assert _fla.rms_norm(h, w, None).dtype == torch.float16
    z = _fla.swiglu(x, g)
    torch.testing.assert_close(z.double(), torch.nn.functional.silu(x.double()) * g.double())
    with pytest.raises(ValueError, match="activation='relu'"):
        _fla.rms_norm_gated(x, g, w, None, "relu")


@needs_fla
def test_layer_with_negative_eigenvalues_equals_the_fp64_layer(monkeypatch):
    """KimiDeltaAttention(allow_neg_eigval=True): beta = 2·sigmoid, in [0, 2]."""
    layer = make_layer(torch.float64, allow_neg_eigval=True)
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(1, 70, LAYER["hidden_size"], generator=gen, dtype=torch.float64)
    d_o = torch.randn(1, 70, LAYER["hidden_size"], generator=gen, dtype=torch.float64)
    with kt.use_with_fla():
        got = layer_step(layer, x, d_o)
    install_references(monkeypatch, "fp64")
    want = layer_step(layer, x, d_o)
    for name, a, b in (("output", got[0], want[0]), ("x.grad", got[1], want[1])):
        assert (a - b).abs().max().item() <= 1e-10 * b.abs().max().item(), name


@needs_fla
@pytest.mark.parametrize("kind,dtype,tol", [("fla", torch.float32, 2e-4),
                                            ("fp64", torch.float64, 1e-10)])
@pytest.mark.parametrize("packed", [False, True])
def test_layer_equals_the_layer_on_references(monkeypatch, kind, dtype, tol, packed):
    """The same fla layer (same weights): through kdacp, and with its ops
    replaced by fla's naive KDA ops (float32) or FP64 references."""
    layer = make_layer(dtype)
    gen = torch.Generator().manual_seed(11)
    shape = (1, 80, LAYER["hidden_size"]) if packed else (2, 48, LAYER["hidden_size"])
    x = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    d_o = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    kw = {"cu_seqlens": torch.tensor([0, 29, 33, 80])} if packed else {}
    with kt.use_with_fla():
        got = layer_step(layer, x, d_o, **kw)
    install_references(monkeypatch, kind)
    want = layer_step(layer, x, d_o, **kw)
    for name, a, b in (("output", got[0], want[0]), ("x.grad", got[1], want[1])):
        err = (a - b).abs().max().item()
        assert err <= tol * b.abs().max().item(), (name, err)
    assert got[2].keys() == want[2].keys() and "A_log" in got[2] and "dt_bias" in got[2]
    for name in want[2]:
        a, b = got[2][name], want[2][name]
        err = (a - b).abs().max().item()
        assert err <= 5 * tol * b.abs().max().item(), (name, err)


@needs_fla
def test_decoding_with_a_cache_continues_the_sequence():
    """Eval without grad: a prefill then a continuation through fla's Cache
    (the KDA state in fla's state_v_first layout, the convolutions' states)
    equal one pass over the whole sequence."""
    from fla.models.cache_utils import Cache
    model = make_model(torch.float64).eval()
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(5))
    with kt.use_with_fla(), torch.no_grad():
        full = model(input_ids=ids, use_cache=False).logits
        cache = Cache()
        first = model(input_ids=ids[:, :25], past_key_values=cache, use_cache=True)
        rest = model(input_ids=ids[:, 25:], past_key_values=first.past_key_values,
                     use_cache=True).logits
    torch.testing.assert_close(torch.cat([first.logits, rest], 1), full, rtol=1e-9, atol=1e-9)


@needs_fla
def test_single_token_decoding_continues_the_sequence():
    """Eval without grad, one token per step after a prefill: the layer's
    single-token path (ShortConvolution.step's causal_conv1d_update, the
    recurrent KDA) through kdacp equals one pass over the whole sequence."""
    from fla.models.cache_utils import Cache
    model = make_model(torch.float64).eval()
    ids = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(6))
    with kt.use_with_fla() as patch, torch.no_grad():
        import fla.modules.causal_conv1d.ops as conv_ops
        assert conv_ops.causal_conv1d_update is kt.causal_conv1d_update and patch.active
        full = model(input_ids=ids, use_cache=False).logits
        out = model(input_ids=ids[:, :12], past_key_values=Cache(), use_cache=True)
        logits, cache = [out.logits], out.past_key_values
        for t in range(12, 20):
            out = model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            logits.append(out.logits)
            cache = out.past_key_values
    torch.testing.assert_close(torch.cat(logits, 1), full, rtol=1e-9, atol=1e-9)


@needs_fla
@pytest.mark.skipif(not hasattr(getattr(torch, "library", None), "custom_op"),
                    reason="torch.library.custom_op needs torch >= 2.4")
def test_fla_model_compiles_fullgraph_and_equals_eager():
    """torch.compile(KDAForCausalLM, fullgraph=True) on kdacp: no graph break
    (kdacp's ops are custom ops, the norms torch), the loss and every
    parameter's gradient eager's bytes (float64). The loss
    is computed outside: fla's own loss code breaks the graph."""
    torch._dynamo.reset()
    model = make_model(torch.float64)
    ids = torch.randint(0, 97, (1, 48), generator=torch.Generator().manual_seed(8))

    def step(m):
        m.zero_grad()
        logits = m(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
        loss.backward()
        return [loss.detach()] + [q.grad.clone() for q in m.parameters()]

    with kt.use_with_fla():
        eager = step(model)
        compiled = step(torch.compile(model, fullgraph=True, backend="aot_eager"))
    assert len(eager) == len(compiled) > 10
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b), (a - b).abs().max().item()


@needs_fla
def test_the_cache_holds_flas_state_layout(monkeypatch):
    """The states the layer leaves in fla's Cache (the KDA state [N, HV, V, K]
    with state_v_first, K != V here; the convolutions' [N, D, W]) equal those
    of the same layer on the FP64 references, and a continuation from them
    equals it too."""
    from fla.models.cache_utils import Cache
    layer = make_layer(torch.float64, expand_v=2, layer_idx=0).eval()
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(2, 30, LAYER["hidden_size"], generator=gen, dtype=torch.float64)

    def run():
        cache = Cache()
        with torch.no_grad():
            a = layer(x[:, :18], past_key_values=cache, use_cache=True)[0]
            state = {k: v for k, v in cache[0].items() if k in ("recurrent_state", "conv_state")}
            state = {"recurrent_state": state["recurrent_state"].clone(),
                     "conv_state": [c.clone() for c in state["conv_state"]]}
            b = layer(x[:, 18:], past_key_values=cache, use_cache=True)[0]
        return torch.cat([a, b], 1), state

    with kt.use_with_fla():
        got, got_state = run()
    install_references(monkeypatch, "fp64")
    want, want_state = run()
    assert list(got_state["recurrent_state"].shape) == [2, 4, 32, 16]  # [N, HV, V, K]
    torch.testing.assert_close(got_state["recurrent_state"], want_state["recurrent_state"],
                               rtol=1e-10, atol=1e-10)
    for a, b in zip(got_state["conv_state"], want_state["conv_state"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@needs_fla
def test_model_trains_on_one_process():
    model = make_model(torch.float32)
    ids = torch.randint(0, 97, (1, 64), generator=torch.Generator().manual_seed(2))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with kt.use_with_fla():
        losses = []
        for _ in range(8):
            opt.zero_grad()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


@needs_fla
def test_layer_and_model_under_cp_equal_one_process():
    """2 ranks (contiguous) and 4 ranks (zigzag), in one spawn of 4."""
    spawn(cp_worker, 4, timeout_s=300)

