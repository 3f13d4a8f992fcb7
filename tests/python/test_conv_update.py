"""kdacp.torch.causal_conv1d_update and causal_conv1d_update_states
(flash-linear-attention's decode-time convolution ops): against an FP64
rolling window written here from the definition, a decode loop against one
causal_conv1d pass, and their errors. Runs under Debian's torch 1.13 too."""

import pytest
import torch

import kdacp.torch as kt

F64 = torch.float64


def window_ref(cache, x, weight, bias, activation, residual):
    """The definition: the window shifts left, takes x last; y = act(Σ w·window + b) + r."""
    window = torch.cat([cache[:, :, 1:], x.unsqueeze(-1)], dim=-1)
    y = (window * weight).sum(-1)
    if bias is not None:
        y = y + bias
    if activation in ("silu", "swish"):
        y = y * torch.sigmoid(y)
    if residual is not None:
        y = y + residual
    return y, window


@pytest.mark.parametrize("activation", [None, "silu", "swish"])
@pytest.mark.parametrize("layout", ["2d", "1nd", "n1d"])
def test_update_equals_the_window_definition(activation, layout):
    gen = torch.Generator().manual_seed(3)
    n, d, w = 3, 5, 4
    x = torch.randn(n, d, generator=gen, dtype=F64)
    cache = torch.randn(n, d, w, generator=gen, dtype=F64)
    weight = torch.randn(d, w, generator=gen, dtype=F64)
    bias = torch.randn(d, generator=gen, dtype=F64)
    residual = torch.randn(n, d, generator=gen, dtype=F64)
    want_y, want_cache = window_ref(cache, x, weight, bias, activation, residual)
    shaped = {"2d": x, "1nd": x.unsqueeze(0), "n1d": x.unsqueeze(1)}[layout]
    res = residual.reshape(shaped.shape)
    mine = cache.clone()
    y, out = kt.causal_conv1d_update(shaped, mine, res, weight, bias, activation)
    assert out is mine and y.shape == shaped.shape
    torch.testing.assert_close(y.reshape(n, d), want_y, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(mine, want_cache, rtol=0, atol=0)  # a shift: exact
    y2, _ = kt.causal_conv1d_update(shaped, cache.clone(), None, weight, None, None)
    torch.testing.assert_close(y2.reshape(n, d), window_ref(cache, x, weight, None, None, None)[0],
                               rtol=1e-13, atol=1e-13)


def test_decode_loop_equals_one_pass_and_update_states_gives_its_cache():
    """A prefill's cache from causal_conv1d_update_states, then one token at
    a time: the outputs equal one causal_conv1d pass and the last cache its
    final_state; float32 and bf16 caches are stored as given."""
    gen = torch.Generator().manual_seed(4)
    b, t, d, w, prefill = 2, 11, 6, 4, 5
    x = torch.randn(b, t, d, generator=gen, dtype=F64)
    weight = torch.randn(d, w, generator=gen, dtype=F64)
    bias = torch.randn(d, generator=gen, dtype=F64)
    full, final = kt.causal_conv1d(x, weight, bias, activation="silu", output_final_state=True)
    cache = kt.causal_conv1d_update_states(x[:, :prefill], w)
    _, want = kt.causal_conv1d(x[:, :prefill], weight, output_final_state=True)
    torch.testing.assert_close(cache, want, rtol=0, atol=0)
    ys = []
    for i in range(prefill, t):
        y, cache = kt.causal_conv1d_update(x[:, i:i + 1], cache, None, weight, bias, "silu")
        ys.append(y)
    torch.testing.assert_close(torch.cat(ys, 1), full[:, prefill:], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cache, final, rtol=0, atol=0)
    c16 = final.to(torch.bfloat16)
    kt.causal_conv1d_update(x[:, :1].float(), c16, None, weight.float())
    assert c16.dtype == torch.bfloat16


def test_update_states_packed_short_and_initial_state():
    """Packed sequences of 0, 1, 2 and 7 tokens with state_len 4: a short
    sequence reaches into its initial_state's newest columns, or zeros."""
    gen = torch.Generator().manual_seed(5)
    d, w = 3, 4
    cu = [0, 0, 1, 3, 10]
    x = torch.randn(1, 10, d, generator=gen, dtype=F64)
    h0 = torch.randn(4, d, w, generator=gen, dtype=F64)
    got = kt.causal_conv1d_update_states(x, w, initial_state=h0, cu_seqlens=torch.tensor(cu))
    for i, (a, e) in enumerate(zip(cu, cu[1:])):
        stream = torch.cat([h0[i].t(), x[0, a:e]], 0)  # oldest first
        torch.testing.assert_close(got[i], stream[-w:].t(), rtol=0, atol=0)
    zero = kt.causal_conv1d_update_states(x[0], w, cu_seqlens=cu)
    assert torch.equal(zero[0], torch.zeros(d, w)) and torch.equal(zero[1][:, :3], torch.zeros(d, 3))


def test_errors_name_the_argument():
    x, cache, weight = torch.randn(2, 3), torch.zeros(2, 3, 4), torch.randn(3, 4)
    with pytest.raises(ValueError, match="weight=None"):
        kt.causal_conv1d_update(x, cache)
    with pytest.raises(ValueError, match="cache=None"):
        kt.causal_conv1d_update(x, None, weight=weight)
    with pytest.raises(ValueError, match=r"cache has shape \[2, 3, 3\], expected \[N, D, W\] = "
                                         r"\[2, 3, 4\]"):
        kt.causal_conv1d_update(x, torch.zeros(2, 3, 3), weight=weight)
    with pytest.raises(ValueError, match="one token per sequence"):
        kt.causal_conv1d_update(torch.randn(2, 2, 3), cache, weight=weight)
    with pytest.raises(ValueError, match="residual has shape"):
        kt.causal_conv1d_update(x, cache, torch.randn(5), weight)
    with pytest.raises(ValueError, match="state_len=0"):
        kt.causal_conv1d_update_states(torch.randn(1, 4, 3), 0)
    with pytest.raises(ValueError, match=r"cu_seqlens \[0, 5\], expected non-decreasing"):
        kt.causal_conv1d_update_states(torch.randn(1, 4, 3), 2, cu_seqlens=[0, 5])
    with pytest.raises(ValueError, match=r"initial_state has shape"):
        kt.causal_conv1d_update_states(torch.randn(1, 4, 3), 2, initial_state=torch.zeros(1, 3, 3))
