"""What kdacp.torch's parts share: the dtypes, tensors as C++ views, the
options read by the CLI's parsers (kdacp/units.hpp), the library's defaults
and the check of a result's finiteness."""

import numbers
import operator

import torch

from kdacp import _kdacp


class _SingleProcess:
    """kda's default group: one process, the whole stream local. Distinct
    from None, which torch.distributed.group.WORLD also is before
    init_process_group and after destroy_process_group."""

    def __repr__(self):
        return "kdacp.torch.SINGLE_PROCESS"


SINGLE_PROCESS = _SingleProcess()

_DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.bfloat16: "bfloat16",
           torch.float16: "float16"}
# kdacp/defaults.hpp, the library's and the CLI's: algorithm, keep_forward, timeout.
_DEFAULTS = _kdacp.defaults()
_DEFAULT_TIMEOUT_S = _DEFAULTS["timeout"]
_EXCHANGE_OPTIONS = ("memory_budget_bytes", "allow_reassociation", "segments", "calibration",
                     "expected_shape", "expected_cuts", "timeout", "threads", "check_ranks",
                     "ulysses")


# -- tensors as C++ views ----------------------------------------------------

def _check_tensor(t, name, ndim=None, prefix=""):
    """A CPU float32/float64/bfloat16/float16 tensor (with ndim dims unless
    None), or ValueError naming it."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{prefix}{name} is a {type(t).__name__}, expected a torch.Tensor")
    if t.device.type != "cpu":
        raise ValueError(f"{prefix}{name} is on {t.device}, expected a CPU tensor")
    if t.dtype not in _DTYPES:
        raise ValueError(f"{prefix}{name} has dtype {t.dtype}, expected torch.float32, "
                         "torch.float64, torch.bfloat16 or torch.float16")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} has shape {list(t.shape)} ({t.dim()} dims), expected {ndim} dims")


def _check_state_tensor(t, name, ndim=None):
    """_check_tensor for a state or transfer matrix: float32 or float64 only
    (states are kept and exchanged in those; bf16/fp16 layer inputs have
    float32 states)."""
    _check_tensor(t, name, ndim)
    if t.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{name} has dtype {t.dtype}, expected torch.float32 or torch.float64")


def _viewable(t):
    """t itself when C++ can view it (unit column stride, batch stride = H x
    head stride, as SPEC §2 asks), else a contiguous copy."""
    s = t.stride()
    if t.dim() >= 4 and s[-1] == 1 and s[-4] == t.shape[-3] * s[-3] and t.storage_offset() >= 0:
        return t
    return t.contiguous()


def _contiguous_cached(t):
    """t when it is contiguous, else a contiguous copy (the values of
    t.contiguous()) in memory from kdacp's buffer cache: huge pages, and the
    next call's copy of the size reuses the block instead of faulting a fresh
    torch allocation in 4 KiB pages (o.sum()'s gradient is an expanded
    scalar, copied on every backward)."""
    if t.is_contiguous():
        return t
    out = torch.from_numpy(_kdacp.cached_bytes(t.numel() * t.element_size()))
    out = out.view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def _desc(t):
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), _DTYPES[t.dtype])


def _from_numpy(a, dtype=None):
    """A C++ result as a tensor (None stays None); a 16-bit one arrives as
    int16 bits and is viewed as `dtype`."""
    if a is None:
        return None
    t = torch.from_numpy(a)
    return t.view(dtype) if dtype in (torch.bfloat16, torch.float16) else t


def _compute_dtype(named, prefix=""):
    """The dtype a call computes in: torch.float64 when its tensors are
    float64, torch.float32 when each is float32, bfloat16 or float16 (16-bit
    ones are widened in C++ and results stored back in their dtypes).
    float64 is all or nothing: ValueError naming the first tensor that
    breaks it. `named`: (tensor or None, name) pairs."""
    given = [(t, n) for t, n in named if t is not None]
    wide = [n for t, n in given if t.dtype == torch.float64]
    if not wide:
        return torch.float32
    for t, n in given:
        if t.dtype != torch.float64:
            raise ValueError(f"{prefix}{n} has dtype {t.dtype} while {wide[0]} is torch.float64: "
                             "float64 inputs must all be float64 (float32, bfloat16 and float16 "
                             "may mix: they compute in float32)")
    return torch.float64


def _integer(value, name, lo, hi):
    """An int option in [lo, hi], checked by the CLI's parser (kdacp/units.hpp):
    ValueError naming the option for anything else (bool, float, str, out of range)."""
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r}, expected an integer in [{lo}, {hi}]")
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name}={value!r}, expected an integer in [{lo}, {hi}]") from None
    return _kdacp.parse_integer(str(value), name, lo, hi)


def _parse_bytes(value):
    """memory_budget_bytes: 0 or None (no budget), a positive int, or a size
    such as '64MiB', read by the CLI's --memory-budget parser (kdacp/units.hpp)."""
    name = "memory_budget_bytes"
    if value is None or (type(value) is int and value == 0):
        return 0
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, str)):
        raise ValueError(f"{name}={value!r}, expected 0 (no budget), a positive int or a size "
                         "such as '64MiB'")
    return _kdacp.parse_bytes(str(operator.index(value)) if not isinstance(value, str) else value,
                              name)


def _options(options, expected=None, expected_dtype=None, expected_cuts=None):
    unknown = sorted(set(options) - set(_EXCHANGE_OPTIONS))
    if unknown:
        raise TypeError(f"unknown exchange option(s) {unknown}, expected some of "
                        f"{list(_EXCHANGE_OPTIONS)}")
    shape = options.get("expected_shape", expected)
    if shape is not None:
        if isinstance(shape, (str, bytes)) or not hasattr(shape, "__len__"):
            raise ValueError(f"expected_shape={shape!r}, expected (B, H, K, V)")
        shape = [_integer(x, "expected_shape", 1, 1 << 32) for x in shape]
    cuts = _expected_cuts(options, expected_cuts)
    _ulysses(options)
    for flag in ("allow_reassociation", "check_ranks"):
        if flag in options and not isinstance(options[flag], bool):
            raise ValueError(f"{flag}={options[flag]!r}, expected True or False")
    calibration = options.get("calibration", "")
    if calibration is None:
        calibration = ""
    if not isinstance(calibration, str):
        raise ValueError(f"calibration={calibration!r}, expected the path of a "
                         "`kdacp calibrate` JSON file")
    return _kdacp.make_options(
        segments=_segments(options),
        memory_budget_bytes=_parse_bytes(options.get("memory_budget_bytes", 0)),
        allow_reassociation=bool(options.get("allow_reassociation", False)),
        calibration=calibration,
        expected_shape=shape,
        expected_dtype=expected_dtype,
        expected_cuts=cuts)


def _expected_cuts(options, default=None):
    """expected_cuts: one flag per part in chain order (True/False or 0/1),
    the parts where the calls are expected to start a sequence; auto and
    segments=0 weigh them. A context derives them from its cu_seqlens."""
    cuts = options.get("expected_cuts", default)
    if cuts is None:
        return None
    if isinstance(cuts, (str, bytes)) or not hasattr(cuts, "__iter__"):
        raise ValueError(f"expected_cuts={cuts!r}, expected a sequence of True/False, one per part")
    out = []
    for i, c in enumerate(cuts):
        if isinstance(c, bool) or (isinstance(c, int) and c in (0, 1)):
            out.append(bool(c))
        else:
            raise ValueError(f"expected_cuts[{i}] is {c!r}, expected True or False")
    return out


ULYSSES_AUTO = 0  # ulysses="auto": the cost model's width (job::kUlyssesAuto)


def _ulysses(options):
    """ulysses: the head groups' width U of the Ulysses layer (kda::UlyssesLayer:
    an all-to-all over U consecutive ranks around the state exchange over P/U);
    1 (default): the context-parallel layer alone; "auto" (ULYSSES_AUTO): the
    cost model's U, with protocol "auto"."""
    value = options.get("ulysses", 1)
    if value == "auto":
        return ULYSSES_AUTO
    if isinstance(value, str):
        raise ValueError(f"ulysses={value!r}, expected an integer in [1, {1 << 16}] or 'auto'")
    return _integer(value, "ulysses", 1, 1 << 16)


def _segments(options):
    return _integer(options.get("segments", 0), "segments", *_kdacp.segments_range)


def _threads(options):
    """threads: the C++ pool's size, in the CLI's --threads range; 0 or
    absent: torch.get_num_threads() (capped at the range's top)."""
    lo, hi = _kdacp.threads_range
    n = _integer(options.get("threads", 0), "threads", lo, hi)
    return n if n > 0 else max(1, min(torch.get_num_threads(), hi))


def _timeout(options):
    """timeout: seconds, a finite number in (0, one day], read by the CLI's
    --timeout parser (kdacp/units.hpp)."""
    t = options.get("timeout", _DEFAULT_TIMEOUT_S)
    if isinstance(t, bool) or not isinstance(t, (numbers.Real, str)):
        raise ValueError(f"timeout={t!r}, expected seconds: a finite number > 0")
    if isinstance(t, numbers.Integral):
        text = str(operator.index(t))
    elif isinstance(t, str):
        text = t
    else:
        text = repr(float(t))
    return _kdacp.parse_timeout(text, "timeout")


def _group_size(value):
    return _integer(value, "allgather_group_size", 1, 1 << 31)


def _require_finite_result(t, name, what):
    """RuntimeError naming the tensor, its first non-finite element and value
    when a forward or backward produced one from finite inputs (the C++
    validator's scan, without the GIL: faster than torch.isfinite().all())."""
    if t is None:
        return
    try:
        _kdacp.check_tensor(t.data_ptr(), list(t.shape), _DTYPES[t.dtype], name, "finite")
    except ValueError as e:
        raise RuntimeError(f"kdacp.torch.kda: the {what} produced a non-finite value from "
                           f"finite inputs: {e}") from None


def caller_stacklevel():
    """warnings.warn's stacklevel that names the first frame outside the
    kdacp package (the user's call), whatever wrappers (torch.compile's entry
    decorator, fused_recurrent_kda over chunk_kda) lie between."""
    import os
    import sys
    package = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == package:
        frame, level = frame.f_back, level + 1
    return level
