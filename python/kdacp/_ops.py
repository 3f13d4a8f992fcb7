"""torch.compile support (docs/compile.md): kdacp.torch's chunk_kda, kda and
causal_conv1d as torch.library custom ops, so that a compiled model calls
them without a graph break.

Each entry point is wrapped by ``entry``: in eager mode the wrapper calls the
function itself (nothing changes); while torch.compile traces it
(torch.compiler.is_compiling()) the call becomes the op ``kdacp::<name>``,
whose eager kernel runs that same function at run time, and whose backward is
the op ``kdacp::<name>_backward``.

Arguments. An op takes tensors, numbers and strings only, so the call's
arguments are encoded (``_encode``): tensors (at any depth) go into the op's
tensor list, symbolic ints (dynamic shapes) into its int list, every other
value into ``spec``, a repr of tagged Python literals that the kernel decodes.
A process group (or a 1-D DeviceMesh, or mesh["cp"]) travels by its
group_name, resolved with torch.distributed's registry; a CpContext travels
as its key tensor (``register_context``), so a new context per batch is a new
input of the same compiled graph, not a recompilation: the kernel looks the
context up in a registry of weak references, where it lives as long as the
caller holds it. A value that cannot be passed is an error raised by the
kernel at run time with eager's type and message.

Memory. When an input needs a gradient, the forward kernel runs the eager
function on detached copies of the inputs (views, no data copied) with grad
enabled, and keeps the autograd graph that call built (the eager forward's
saved state: its inputs and the C++ layer's intermediates, exactly what eager
keeps) in a holder owned by the storage of the op's third output, the handle
(one int64, the holder's key). The compiled graph saves the handle for its
backward; the backward kernel finds the graph by that key and runs it. The
graph is freed when the handle is: after the compiled backward, or when the
forward's result is dropped without a backward. The outputs themselves are
not kept (the graph is reached from its GradientEdges). Without an input
that needs a gradient the kernel runs the function under no_grad and keeps
nothing. Gradients are therefore eager's, computed by eager's code: the same
bytes.
"""

import ast
import contextlib
import functools
import inspect
import itertools
import math
import weakref

import numpy as np
import torch

from kdacp import _comm
from kdacp._common import SINGLE_PROCESS

_IS_COMPILING = getattr(getattr(torch, "compiler", None), "is_compiling", None)
# torch.library.custom_op (torch >= 2.4); without it the entry points stay
# eager (torch.compile then traces into them as any Python function).
AVAILABLE = hasattr(getattr(torch, "library", None), "custom_op")
# GradientEdge outputs of torch.autograd.grad (torch >= 2.5): the forward's
# outputs need not be kept for the backward.
_EDGES = hasattr(getattr(torch.autograd, "graph", None), "get_gradient_edge") and \
    tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


def compiling():
    """Whether torch.compile (dynamo) is tracing this call."""
    return _IS_COMPILING is not None and AVAILABLE and _IS_COMPILING()


# -- contexts -----------------------------------------------------------------

_CONTEXTS = weakref.WeakValueDictionary()
_CONTEXT_KEYS = itertools.count(1)


def register_context(ctx, sequences):
    """Gives a CpContext its key tensor (the op input that names it) and the
    number of its sequences (-1: one per batch row), read while tracing for
    the shape of the final state."""
    key = next(_CONTEXT_KEYS)
    _CONTEXTS[key] = ctx
    ctx._op_key = torch.tensor([key], dtype=torch.int64)
    ctx._op_sequences = int(sequences)


# -- the call's arguments, encoded ---------------------------------------------

_DTYPE_CODES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _group_types():
    try:
        import torch.distributed as dist
        return (dist.ProcessGroup,) if dist.is_available() else ()
    except (ImportError, AttributeError):
        return ()


_PROCESS_GROUP = _group_types()


def _encode(value, name, tensors, ints, found):
    """value as a tagged literal (see _decode); tensors and symbolic ints are
    appended to their lists. found: {"context": key tensor or None,
    "sequences": int}."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return ("t", len(tensors) - 1)
    if isinstance(value, (np.generic, np.ndarray)):  # dynamo traces these as tensors
        return ("e", f"{name} is a numpy value: under torch.compile kdacp takes a Python "
                     "number, a list of them or a tensor there")
    if isinstance(value, torch.SymInt):
        ints.append(value)
        return ("i", len(ints) - 1)
    if isinstance(value, torch.SymFloat):
        tensors.append(torch.scalar_tensor(value, dtype=torch.float64))
        return ("f", len(tensors) - 1)
    if value is None or isinstance(value, (bool, int, str)):
        return ("v", value)
    if isinstance(value, float):
        return ("v", value) if math.isfinite(value) else ("x", repr(value))
    if isinstance(value, (list, tuple)):
        return ("l" if isinstance(value, list) else "u",
                [_encode(x, name, tensors, ints, found) for x in value])
    if value is SINGLE_PROCESS:
        return ("s", None)
    if _comm.is_device_mesh(value) or isinstance(value, _PROCESS_GROUP):
        try:
            group = _comm.as_process_group(value, name)
        except ValueError as e:
            return ("e", str(e))
        return ("g", group.group_name)
    if getattr(value, "_op_key", None) is not None:
        found["context"] = value._op_key
        found["sequences"] = value._op_sequences
        return ("c", None)
    return ("e", f"{name} is a {type(value).__name__}: under torch.compile kdacp passes "
                 "tensors, Python numbers, strings, None, lists of them, process groups, "
                 "1-D device meshes and CpContexts (docs/compile.md)")


def _decode(tag, tensors, ints, context):
    kind, value = tag
    if kind == "v":
        return value
    if kind == "t":
        return tensors[value]
    if kind == "i":
        return int(ints[value])
    if kind == "f":
        return float(tensors[value].item())
    if kind == "x":
        return float(value)
    if kind in ("l", "u"):
        items = [_decode(x, tensors, ints, context) for x in value]
        return items if kind == "l" else tuple(items)
    if kind == "s":
        return SINGLE_PROCESS
    if kind == "g":
        from torch.distributed.distributed_c10d import _resolve_process_group
        return _resolve_process_group(value)
    if kind == "c":
        ctx = _CONTEXTS.get(int(context[0])) if context is not None else None
        if ctx is None:
            raise RuntimeError("kdacp: the cp_context of this compiled call is gone (a "
                               "CpContext must stay alive while calls on it run)")
        return ctx
    raise ValueError(value)  # "e": the message of an argument that cannot be passed


@functools.lru_cache(maxsize=256)
def _parse(spec):
    """The (name, tag) pairs of a spec (a compiled graph passes the same few)."""
    return ast.literal_eval(spec)


def _arguments(spec, tensors, ints, context):
    return {name: _decode(tag, tensors, ints, context) for name, tag in _parse(spec)}


# -- the forward's autograd graph, owned by the handle ------------------------

class _Holder(np.ndarray):
    """The handle's memory ([key]); its attributes keep the eager call's
    autograd graph: roots (output slot, GradientEdge or tensor), leaves."""


_HELD = weakref.WeakValueDictionary()
_HELD_KEYS = itertools.count(1)


def _hold(roots, leaves):
    key = next(_HELD_KEYS)
    holder = np.array([key], dtype=np.int64).view(_Holder)
    holder.roots, holder.leaves = roots, leaves
    _HELD[key] = holder
    return torch.from_numpy(holder)  # the tensor's storage owns the holder


def _fresh(t, others):
    """t, contiguous, not sharing memory with any of `others` (an op's output
    may not alias its inputs)."""
    t = t.detach().contiguous()
    ptr = t.untyped_storage().data_ptr()
    if any(o is not None and o.numel() and o.untyped_storage().data_ptr() == ptr
           for o in others) and t.numel():
        t = t.clone()
    return t


@contextlib.contextmanager
def _autograd_dispatch(train):
    """A custom op's kernel runs below autograd (the dispatcher excludes the
    autograd and ADInplaceOrView keys there), so torch's own ops inside it
    (a reshape, a transpose, a cat) would record no graph and the eager
    function's gradients would stop at them. Training forwards run with
    those keys included again; autograd.Functions record either way."""
    if not train:
        yield
        return
    keys = torch._C.DispatchKey
    with torch._C._SetExcludeDispatchKeyGuard(keys.ADInplaceOrView, False), \
            torch._C._SetExcludeDispatchKeyGuard(keys.AutogradFunctionality, False):
        yield


def _run_forward(entry, tensors, spec, context, ints, grad_mask):
    leaves = []
    inputs = list(tensors)
    for i, needs in enumerate(grad_mask):
        if needs:
            inputs[i] = tensors[i].detach().requires_grad_(True)
            leaves.append(inputs[i])
    kwargs = _arguments(spec, inputs, ints, context)
    train = bool(leaves)
    with torch.enable_grad() if train else torch.no_grad(), _autograd_dispatch(train):
        out, state = entry.fn(**kwargs)
    expected = entry.fake(kwargs, _context_sequences(kwargs))
    handle = torch.zeros(1, dtype=torch.int64)
    if train:
        roots = [(slot, torch.autograd.graph.get_gradient_edge(x) if _EDGES else x)
                 for slot, x in enumerate((out, state)) if x is not None and x.requires_grad]
        handle = _hold(roots, leaves)
    results = []
    for x, want, what in zip((out, state), expected, ("output", "final state")):
        x = want if x is None else _fresh(x, tensors)
        if x.shape != want.shape or x.dtype != want.dtype:
            raise RuntimeError(f"kdacp.torch.{entry.name}: the {what} is {x.dtype} "
                               f"{list(x.shape)}, the compiled graph expected {want.dtype} "
                               f"{list(want.shape)} (a kdacp bug: please report it)")
        results.append(x)
    return results[0], results[1], handle


def _context_sequences(kwargs):
    ctx = kwargs.get("cp_context")
    return getattr(ctx, "_op_sequences", -1)


def _run_backward(handle, d_out, d_state):
    holder = _HELD.get(int(handle[0]))
    if holder is None:
        raise RuntimeError("kdacp: the saved state of a compiled forward is gone: its handle "
                           "tensor was copied and the original freed (a saved-tensor hook "
                           "that copies what autograd saves), which kdacp's compiled ops do "
                           "not support")
    roots = [edge for _, edge in holder.roots]
    grads = [(d_out, d_state)[slot] for slot, _ in holder.roots]
    result = torch.autograd.grad(roots, holder.leaves, grads, retain_graph=True,
                                 allow_unused=True) if roots else [None] * len(holder.leaves)
    return [torch.zeros_like(leaf) if g is None else _fresh(g, (d_out, d_state))
            for g, leaf in zip(result, holder.leaves)]


# -- the ops -------------------------------------------------------------------

def _define(entry):
    from typing import List, Optional, Tuple
    from torch import Tensor

    name = entry.name

    def forward(tensors: List[Optional[Tensor]], spec: str, context: Optional[Tensor],
                ints: List[int], sequences: int,
                grad_mask: List[bool]) -> Tuple[Tensor, Tensor, Tensor]:
        return _run_forward(entry, tensors, spec, context, ints, grad_mask)

    def forward_fake(tensors, spec, context, ints, sequences, grad_mask):
        kwargs = _arguments_fake(spec, tensors, ints)
        out, state = entry.fake(kwargs, sequences)
        return out, state, torch.empty(1, dtype=torch.int64)

    def backward(handle: Tensor, d_out: Tensor, d_state: Tensor, sizes: List[int],
                 dtypes: List[int]) -> List[Tensor]:
        return _run_backward(handle, d_out, d_state)

    def backward_fake(handle, d_out, d_state, sizes, dtypes):
        out, at = [], 0
        for code in dtypes:
            dims = sizes[at]
            out.append(d_out.new_empty(sizes[at + 1:at + 1 + dims], dtype=_DTYPE_CODES[code]))
            at += 1 + dims
        return out

    fwd = torch.library.custom_op(f"kdacp::{name}", forward, mutates_args=())
    fwd.register_fake(forward_fake)
    bwd = torch.library.custom_op(f"kdacp::{name}_backward", backward, mutates_args=())
    bwd.register_fake(backward_fake)

    def setup_context(ctx, inputs, output):
        tensors, _, _, ints, _, grad_mask = inputs
        ctx.grad_mask, ctx.ints = list(grad_mask), len(ints)
        sizes, dtypes = [], []
        for t, needs in zip(tensors, grad_mask):
            if needs:
                sizes += [t.dim(), *t.shape]
                dtypes.append(_DTYPE_CODES.index(t.dtype))
        ctx.sizes, ctx.dtypes = sizes, dtypes
        # The outputs' shapes only (for a gradient torch leaves as None):
        # keeping the outputs would hold their memory until the backward.
        ctx.metas = [(x.shape, x.dtype) for x in output[:2]]
        ctx.save_for_backward(output[2])

    def grad(ctx, d_out, d_state, _d_handle):
        (handle,) = ctx.saved_tensors
        d_out, d_state = (torch.zeros(shape, dtype=dtype) if d is None else d
                          for d, (shape, dtype) in zip((d_out, d_state), ctx.metas))
        grads = iter(bwd(handle, d_out, d_state, ctx.sizes, ctx.dtypes))
        return ([next(grads) if needs else None for needs in ctx.grad_mask], None, None,
                [None] * ctx.ints, None, None)

    fwd.register_autograd(grad, setup_context=setup_context)
    return fwd


_CONTEXT_MARK = object()  # a cp_context while tracing


def _arguments_fake(spec, tensors, ints):
    """The call's arguments while tracing (a context or group as None: the
    shapes do not need them)."""
    def decode(tag):
        kind, value = tag
        if kind in ("l", "u"):
            items = [decode(x) for x in value]
            return items if kind == "l" else tuple(items)
        if kind == "c":
            return _CONTEXT_MARK
        if kind in ("g", "s", "e", "f"):
            return None
        return _decode(tag, tensors, ints, None)
    return {name: decode(tag) for name, tag in _parse(spec)}


class _Entry:
    def __init__(self, name, fn, fake):
        self.name, self.fn, self.fake = name, fn, fake
        params = inspect.signature(fn).parameters.values()
        self.positional = tuple(p.name for p in params
                                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
        self.op = _define(self) if AVAILABLE else None

    def call(self, args, kwargs):
        """The op's call for fn(*args, **kwargs), traced by dynamo."""
        if len(args) > len(self.positional):
            raise TypeError(f"{self.name}() takes at most {len(self.positional)} positional "
                            f"arguments but {len(args)} were given")
        bound = dict(zip(self.positional, args))
        for key in kwargs:
            if key in bound:
                raise TypeError(f"{self.name}() got multiple values for argument '{key}'")
        bound.update(kwargs)
        tensors, ints, found = [], [], {"context": None, "sequences": -1}
        spec = tuple((key, _encode(value, key, tensors, ints, found))
                     for key, value in bound.items())
        grad = torch.is_grad_enabled()
        grad_mask = [grad and t.requires_grad and t.dtype in _DTYPE_CODES for t in tensors]
        out, state, _ = self.op(tensors, repr(spec), found["context"], ints,
                                found["sequences"], grad_mask)
        return out, (state if bound.get("output_final_state", False) is True else None)


def entry(name, fake):
    """Decorator: fn as an eager function that becomes the op kdacp::<name>
    under torch.compile. fake(kwargs, sequences) -> (output, final state) as
    empty tensors of the shapes and dtypes fn returns for those arguments
    (the final state: 0 elements when it is not requested)."""
    def wrap(fn):
        spec = _Entry(name, fn, fake)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if compiling():
                return spec.call(args, kwargs)
            return fn(*args, **kwargs)
        wrapper.kdacp_op = spec.op
        return wrapper
    return wrap


# -- shapes of the entry points' results ----------------------------------------

def _is4(*ts):
    return all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in ts)


def _sequences(kwargs, batch, sequences, names=("cu_seqlens", "cu_seqlens_cpu")):
    """N, the final state's rows: the context's sequences, else those of
    cu_seqlens (or cu_seqlens_cpu), else the batch."""
    if kwargs.get("cp_context") is not None or sequences >= 0:
        return batch if sequences < 0 else sequences
    for name in names:
        cu = kwargs.get(name)
        if cu is not None:
            return (cu.shape[0] if isinstance(cu, torch.Tensor) else len(cu)) - 1
    return batch


def kda_fake(kwargs, sequences):
    """chunk_kda's and kda's: o like v; ht [N, HV, K, V] in the state dtype."""
    q, v = kwargs.get("q"), kwargs.get("v")
    if not _is4(q, v):  # eager raises its error at run time
        t = v if isinstance(v, torch.Tensor) else torch.empty(0)
        return t.new_empty(t.shape), t.new_empty(0)
    state = torch.float64 if q.dtype == torch.float64 else torch.float32
    o = v.new_empty(v.shape)
    if kwargs.get("output_final_state", False) is not True:
        return o, v.new_empty(0, dtype=state)
    n = _sequences(kwargs, q.shape[0], sequences)
    return o, v.new_empty((max(n, 0), v.shape[2], q.shape[3], v.shape[3]), dtype=state)


def chunk_kda_fake(kwargs, sequences):
    """chunk_kda's: kda's, with o in q's dtype (flash-linear-attention's) and
    ht [N, HV, V, K] with state_v_first (or the deprecated
    transpose_state_layout)."""
    o, ht = kda_fake(kwargs, sequences)
    q = kwargs.get("q")
    if not _is4(q, kwargs.get("v")):
        return o, ht
    if kwargs.get("state_v_first") is True or kwargs.get("transpose_state_layout") is True:
        if ht.dim() == 4:
            ht = ht.new_empty((ht.shape[0], ht.shape[1], ht.shape[3], ht.shape[2]))
    return o.new_empty(o.shape, dtype=q.dtype), ht


def conv_fake(kwargs, sequences):
    """causal_conv1d's: y like x; final_state [N, D, W] as x."""
    x, w = kwargs.get("x"), kwargs.get("weight")
    if not (isinstance(x, torch.Tensor) and x.dim() == 3 and isinstance(w, torch.Tensor)
            and w.dim() == 2):
        t = x if isinstance(x, torch.Tensor) else torch.empty(0)
        return t.new_empty(t.shape), t.new_empty(0)
    y = x.new_empty(x.shape)
    if kwargs.get("output_final_state", False) is not True:
        return y, x.new_empty(0)
    n = _sequences(kwargs, x.shape[0], sequences)
    return y, x.new_empty((max(n, 0), x.shape[2], w.shape[1]))
