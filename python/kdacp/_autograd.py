"""What kdacp.torch's autograd Functions share: the cu_seqlens reader and the
guard that makes their first-order gradients refuse a second backward."""

import operator

import torch


def cu_list(cu_seqlens, op=""):
    """cu_seqlens as a list of Python ints: a 1-D int32/int64 tensor, or a
    sequence of integers (a float, even 2.0, is an error: never truncated).
    op: the function named at the start of each message ("" for none)."""
    prefix = f"{op}: " if op else ""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1:
            raise ValueError(f"{prefix}cu_seqlens is {cu_seqlens.dtype} with "
                             f"{cu_seqlens.dim()} dims, expected a 1-D int32 or int64 tensor")
        if cu_seqlens.device.type == "meta":  # no values to read: say so, not torch's error
            raise ValueError(f"{prefix}cu_seqlens is on the meta device, expected its values on "
                             "the CPU (or a device it can be copied from)")
        return [int(x) for x in cu_seqlens.tolist()]
    if isinstance(cu_seqlens, (str, bytes)) or not hasattr(cu_seqlens, "__iter__"):
        raise ValueError(f"{prefix}cu_seqlens={cu_seqlens!r}, expected a 1-D integer tensor or "
                         "a sequence of integers")
    cu = []
    for i, x in enumerate(cu_seqlens):
        if isinstance(x, bool):
            raise ValueError(f"{prefix}cu_seqlens[{i}] is {x!r}, expected an integer")
        try:
            cu.append(operator.index(x))
        except TypeError:
            raise ValueError(f"{prefix}cu_seqlens[{i}] is {x!r} ({type(x).__name__}), expected "
                             "an integer (sequence boundaries are token indices, never "
                             "truncated)") from None
        if not 0 <= cu[-1] < 1 << 63:
            raise ValueError(f"{prefix}cu_seqlens[{i}] is {cu[-1]}, expected a token index >= 0")
    return cu


class _NoSecondOrder(torch.autograd.Function):
    """Marks a first-order gradient computed under create_graph=True: the same
    values, but a backward through them raises (kdacp's C++ backwards have no
    derivative of their own). torch's once_differentiable would not do: it
    marks nothing when the incoming gradient needs no grad (loss.sum()), and
    the second-order part was then silently dropped."""

    @staticmethod
    def forward(ctx, name, grad, *anchors):
        ctx.name = name
        return grad.view_as(grad)

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(
            f"kdacp.torch.{ctx.name} is differentiable once: a double backward through it "
            "(torch.autograd.grad(..., create_graph=True) then a backward through its "
            "gradient, gradgradcheck) is not supported (once_differentiable)")


def first_order(name, grads, inputs):
    """grads as they are when no graph is being built; under create_graph=True
    each one refuses a second backward, naming `name`. inputs: the tensors the
    gradients are of (those that require grad anchor the guard in the graph)."""
    if not torch.is_grad_enabled():
        return list(grads)
    anchors = [t for t in inputs if t is not None and t.requires_grad]
    return [None if x is None else _NoSecondOrder.apply(name, x, *anchors) for x in grads]
