"""PyTorch interface of kdacp (SPEC §11): the state exchange over a
torch.distributed group, the serial fold, and a differentiable CP KDA layer.

    import kdacp.torch as kt
    ex = kt.build_kda_state_cp(group=None, protocol="auto", allgather_group_size=1, **options)
    incoming   = ex.forward(state, matrix)        # [B,H,K,V], [B,H,K,K]
    final_grad = ex.backward(gradient, matrix)
    x = kt.merge_affine_summaries(states, matrices, rank, forward=True)
    o, ht = kt.kda(q, k, v, g, beta, ...)
    ctx = kt.build_cp_context(cu_seqlens, group, ...)        # once per batch
    o, ht = kt.chunk_kda(q, k, v, g, beta, ..., cp_context=ctx)  # flash-linear-attention's op
    with kt.use_with_fla() as fla_on_kdacp:                   # fla's own layers and models
        with fla_on_kdacp.cp(ctx): out = model(input_ids=this_ranks_ids)

Tensors are CPU float32 or float64. Inputs C++ can view (unit column stride,
batch stride = H x head stride) are used in place; others are copied once.
Results alias C++-owned memory (no copy). Invalid input raises ValueError
before anything is sent (kda's values by the C++ validator the CLI uses, with
its messages); arguments that differ between ranks raise ValueError on every
rank naming them; a failed or silent peer raises RuntimeError naming it
within the timeout; a non-finite kda result raises RuntimeError naming it.
Under torch.compile (torch >= 2.4) chunk_kda, kda and causal_conv1d run as the
custom ops torch.ops.kdacp.* without graph breaks (docs/compile.md).
"""

from kdacp._chunk import FlaAssertionError, chunk_kda
from kdacp._common import SINGLE_PROCESS
from kdacp._context import CpContext, build_cp_context, get_cp_cu_seqlens
from kdacp._conv import causal_conv1d
from kdacp._conv_update import causal_conv1d_update, causal_conv1d_update_states
from kdacp._gate import fused_kda_gate, kda_gate_bwd, kda_gate_chunk_cumsum, kda_gate_fwd
from kdacp._recurrent import fused_recurrent_kda, fused_recurrent_kda_fwd
from kdacp._fla import FlaPatch, use_with_fla
from kdacp._exchange import StateExchange, build_kda_state_cp, merge_affine_summaries
from kdacp._layer import kda

__all__ = ["build_kda_state_cp", "merge_affine_summaries", "kda", "StateExchange",
           "SINGLE_PROCESS", "chunk_kda", "build_cp_context", "CpContext", "causal_conv1d",
           "get_cp_cu_seqlens", "fused_recurrent_kda", "fused_recurrent_kda_fwd",
           "fused_kda_gate", "kda_gate_fwd", "kda_gate_bwd", "kda_gate_chunk_cumsum",
           "FlaAssertionError", "use_with_fla", "FlaPatch", "causal_conv1d_update",
           "causal_conv1d_update_states"]

# Their home is this module (help(), repr, pickling), whichever file defines them.
for _public in (StateExchange, build_kda_state_cp, merge_affine_summaries, kda, chunk_kda,
                CpContext, build_cp_context, get_cp_cu_seqlens, causal_conv1d,
                type(SINGLE_PROCESS), fused_recurrent_kda, fused_recurrent_kda_fwd,
                fused_kda_gate, kda_gate_fwd, kda_gate_bwd, kda_gate_chunk_cumsum,
                FlaAssertionError, use_with_fla, FlaPatch, causal_conv1d_update,
                causal_conv1d_update_states):
    _public.__module__ = __name__
del _public
