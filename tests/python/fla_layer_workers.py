"""Helpers of test_fla_layers: flash-linear-attention's KDA layer and model
(built here, tiny), the references its ops are checked against (fla's naive
KDA ops, or FP64 formulas and kda_oracle's recurrence), installed into fla's
modules in place of its Triton kernels, and the rank function comparing the
layer and the model under CP with one process."""

import torch
import torch.distributed as dist
import torch.nn.functional as F

import dist_workers
import kdacp.torch as kt
from conv_reference import causal_conv1d_ref
from kda_oracle import naive_kda
from shares import summed

LAYER = dict(hidden_size=64, head_dim=16, num_heads=2, num_v_heads=4, conv_size=4)
MODEL = dict(hidden_size=64, head_dim=16, num_heads=4, num_hidden_layers=2, vocab_size=97,
             hidden_ratio=2, fuse_cross_entropy=False)


def make_layer(dtype, seed=0, **kw):
    from fla.layers import KimiDeltaAttention
    torch.manual_seed(seed)
    return KimiDeltaAttention(**{**LAYER, **kw}).to(dtype)


def make_model(dtype, seed=0, **kw):
    from fla.models import KDAConfig, KDAForCausalLM
    torch.manual_seed(seed)
    return KDAForCausalLM(KDAConfig(**{**MODEL, **kw})).to(dtype)


def _l2(x):
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


def reference_chunk_kda(kind):
    """fla's chunk_kda as the KDA layer calls it, from references: kind
    "fla": fla.ops.kda.naive's gate and recurrence (they compute in float32),
    per sequence; "fp64": the FP64 gate formula and kda_oracle's recurrence."""
    from fla.ops.kda.gate import naive_kda_gate
    from fla.ops.kda.naive import naive_recurrent_kda

    def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
            use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, safe_gate=False,
            lower_bound=None, state_v_first=False, cu_seqlens=None, A_log=None, dt_bias=None):
        assert lower_bound is None
        c = torch.float64 if kind == "fp64" else torch.float32
        q, k, v, g, beta = (x.to(c) for x in (q, k, v, g, beta))
        hv, kd = g.shape[2], g.shape[3]
        if use_gate_in_kernel:
            if kind == "fla":
                g = naive_kda_gate(g, A_log, dt_bias, output_dtype=c)
            else:
                g = -A_log.to(c).exp().view(hv, 1) * F.softplus(g + dt_bias.to(c).view(hv, kd))
        if use_qk_l2norm_in_kernel:
            q, k = _l2(q), _l2(k)
        if use_beta_sigmoid_in_kernel:
            beta = (2 if allow_neg_eigval else 1) * torch.sigmoid(beta)
        h0 = initial_state
        if h0 is not None and state_v_first:
            h0 = h0.transpose(-1, -2)
        h0 = None if h0 is None else h0.to(c)
        if kind == "fp64":
            o, ht = naive_kda(q, k, v, g, beta, scale, h0, cu_seqlens)
        else:
            cu = ([0, q.shape[1]] if cu_seqlens is None else [int(x) for x in cu_seqlens])
            rows = [(b, n) for b in range(q.shape[0]) for n in range(len(cu) - 1)]
            outs, finals = [], []
            for b, n in rows:
                a, e = cu[n], cu[n + 1]
                s = b if cu_seqlens is None else n
                o_n, h_n = naive_recurrent_kda(
                    *(x[b:b + 1, a:e] for x in (q, k, v, g, beta)), scale,
                    None if h0 is None else h0[s:s + 1], True)
                outs.append(o_n)
                finals.append(h_n)
            per_row = len(cu) - 1
            o = torch.cat([torch.cat(outs[r * per_row:(r + 1) * per_row], 1)
                           for r in range(q.shape[0])], 0)
            ht = torch.cat(finals, 0)
        if state_v_first:
            ht = ht.transpose(-1, -2)
        return o.to(v.dtype), (ht if output_final_state else None)
    return run


def reference_conv(x, weight=None, bias=None, residual=None, initial_state=None,
                   output_final_state=False, activation=None, backend=None, cu_seqlens=None,
                   chunk_indices=None, **kw):
    assert residual is None and not kw
    return causal_conv1d_ref(x, weight, bias, activation, initial_state, output_final_state,
                             cu_seqlens)


def reference_norm_gated(x, g, weight, bias, activation="swish", residual=None, prenorm=False,
                         residual_in_fp32=False, eps=1e-6):
    """The gated RMSNorm from its definition, in float64."""
    assert residual is None and not prenorm and bias is None
    xd, gd = x.double(), g.double()
    y = xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + eps) * weight.double()
    gate = 1 / (1 + torch.exp(-gd))
    y = y * (gate if activation == "sigmoid" else gd * gate)
    return y.to(x.dtype)


def install_references(monkeypatch, kind):
    """fla's KDA layer's Triton ops replaced by the references (the test's
    monkeypatch undoes it)."""
    import fla.layers.kda
    import fla.modules.causal_conv1d.ops
    import fla.modules.norm.fused_norm_gate
    monkeypatch.setattr(fla.layers.kda, "chunk_kda", reference_chunk_kda(kind))
    # eval without grad on <= 64 tokens: the same recurrence
    monkeypatch.setattr(fla.layers.kda, "fused_recurrent_kda", reference_chunk_kda(kind))
    monkeypatch.setattr(fla.modules.causal_conv1d.ops, "causal_conv1d", reference_conv)
    monkeypatch.setattr(fla.modules.norm.fused_norm_gate, "rms_norm_gated",
                        reference_norm_gated)


def grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def layer_step(layer, x, d_o, **kw):
    """(output, input grad, parameter grads) of one forward/backward."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    o = layer(x, **kw)[0]
    (o * d_o).sum().backward()
    return o.detach(), x.grad, grads(layer)


# -- under CP --------------------------------------------------------------------

CU = [0, 37, 60, 96]
T = CU[-1]


def _close(got, want, what, tol):
    err = (got - want).abs().max().item()
    top = want.abs().max().item()
    assert err <= tol * max(top, 1.0), (what, err, top)


def model_loss(model, ids, targets, count, **kw):
    logits = model(input_ids=ids, **kw).logits
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum",
                           ignore_index=-100) / count


def cp_worker(rank, world, init_file):
    """fla's layer and its model (float64, packed documents) under CP equal
    one process: the outputs of this rank's tokens, the input's gradient, the
    loss, and the parameters' gradients summed over the ranks; on ranks
    {0, 1} (contiguous), then on all `world` ranks (zigzag)."""
    dist_workers.init(rank, world, init_file, timeout_s=60)
    pair = dist.new_group([0, 1])
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1, T, LAYER["hidden_size"], generator=gen, dtype=torch.float64)
    d_o = torch.randn(1, T, LAYER["hidden_size"], generator=gen, dtype=torch.float64)
    ids = torch.randint(0, MODEL["vocab_size"], (1, T), generator=gen)
    targets = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], 1)
    for end in CU[1:]:
        targets[0, end - 1] = -100  # no prediction across a document's end
    count = int((targets != -100).sum())
    cu = torch.tensor(CU)
    with kt.use_with_fla() as fla_on_kdacp:
        layer = make_layer(torch.float64)
        model = make_model(torch.float64)
        one = layer_step(layer, x, d_o, cu_seqlens=cu)
        model.zero_grad(set_to_none=True)
        loss = model_loss(model, ids, targets, count, cu_seqlens=cu)
        loss.backward()
        one += (loss.detach(), grads(model))
        model.eval()
        with torch.no_grad():
            one += (model(input_ids=ids, use_cache=False, cu_seqlens=cu).logits,)
        model.train()
        data = (x, d_o, ids, targets, count, cu)
        if rank < 2:
            _check_cp(fla_on_kdacp, layer, model, data, one, pair, "contiguous")
        _check_cp(fla_on_kdacp, layer, model, data, one, dist.group.WORLD, "zigzag")
    dist_workers.finish()


def _check_cp(fla_on_kdacp, layer, model, data, one, group, layout):
    x, d_o, ids, targets, count, cu = data
    o1, dx1, g1, l1, m1, logits1 = one
    ctx = kt.build_cp_context(cu, group, conv1d_kernel_size=LAYER["conv_size"],
                              layout=layout, timeout=30, threads=1)
    spans = ctx.global_layout.local_parts(ctx.rank)

    def local(t):
        return torch.cat([t[:, a:e] for a, e in spans], 1)

    where = f"{layout} over {ctx.world_size} ranks"
    with fla_on_kdacp.cp(ctx):
        o, dx, g = layer_step(layer, local(x), local(d_o), cu_seqlens=ctx.cu_seqlens)
    _close(o, local(o1), f"{where}: layer output", 1e-10)
    _close(dx, local(dx1), f"{where}: layer input grad", 1e-10)
    assert g.keys() == g1.keys()
    for name in g:
        _close(summed(g[name], group), g1[name], f"{where}: layer {name}.grad", 1e-10)
    # The model on a context of its own (its calls' arguments differ from the layer's).
    ctx = kt.build_cp_context(cu, group, conv1d_kernel_size=4, layout=layout, timeout=30,
                              threads=1)
    model.zero_grad(set_to_none=True)
    with fla_on_kdacp.cp(ctx):
        loss = model_loss(model, local(ids), local(targets), count, cu_seqlens=ctx.cu_seqlens)
    loss.backward()
    _close(summed(loss.detach(), group), l1, f"{where}: model loss", 1e-12)
    m = grads(model)
    assert m.keys() == m1.keys()
    for name in m:
        _close(summed(m[name], group), m1[name], f"{where}: model {name}.grad", 1e-10)
    model.eval()
    with torch.no_grad(), fla_on_kdacp.cp(ctx):
        logits = model(input_ids=local(ids), use_cache=False, cu_seqlens=ctx.cu_seqlens).logits
    model.train()
    # eval without grad on at most 64 local tokens: the layer picks fused_recurrent_kda
    _close(logits, local(logits1), f"{where}: model logits (eval, no grad)", 1e-10)
