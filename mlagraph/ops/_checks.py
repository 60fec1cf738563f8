"""Argument checks shared by every op's real and fake kernel.

Each op calls one ``check_*`` function from both its reference implementation and its fake
kernel, so a bad shape, dtype or device raises the same ``ValueError`` eagerly, under
``FakeTensorMode`` and while tracing with ``torch.compile``. Messages always name the op, the
argument, what was expected and what was got.

Shapes may be symbolic (``SymInt``) under fake tensors with dynamic shapes. The checks compare
sizes with ``!=``, which for a symbolic size installs a guard rather than reading a value, and
never touch tensor data.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

INDEX_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fail(op: str, arg: str, expected: str, got: object) -> None:
    raise ValueError(f"mlagraph.{op}: argument '{arg}': expected {expected}, got {got}")


def _dims_str(dims: Sequence[object]) -> str:
    return "[" + ", ".join(str(d) for d in dims) + "]"


def check_tensor(
    op: str,
    arg: str,
    t: object,
    *,
    ndim: int | None = None,
    shape: Sequence[object] | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
) -> None:
    """Checks one tensor argument.

    ``shape`` entries may be ints (or SymInts) that must match, or ``None`` for "any size";
    when ``shape`` is given its length is also the expected number of dimensions.
    """
    if not isinstance(t, torch.Tensor):
        fail(op, arg, "a Tensor", type(t).__name__)
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and t.dim() != ndim:
        want = _dims_str(["*" if s is None else s for s in shape]) if shape is not None else f"{ndim} dims"
        fail(op, arg, f"a {ndim}-d tensor of shape {want}", f"shape {list(t.shape)}")
    if shape is not None:
        for i, want in enumerate(shape):
            if want is not None and t.shape[i] != want:
                fail(
                    op,
                    arg,
                    f"shape {_dims_str(['*' if s is None else s for s in shape])}",
                    f"shape {list(t.shape)} (dim {i} is {t.shape[i]}, not {want})",
                )
    if dtypes is not None and t.dtype not in dtypes:
        names = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        fail(op, arg, f"dtype {names}", str(t.dtype).replace("torch.", ""))
    if device is not None and t.device != device:
        fail(op, arg, f"a tensor on {device} (the device of the other inputs)", f"a tensor on {t.device}")


def check_same_dtype(op: str, arg: str, t: torch.Tensor, ref_arg: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        fail(op, arg, f"the dtype of '{ref_arg}' ({ref.dtype})", str(t.dtype))


def check_choice(op: str, arg: str, value: object, choices: Sequence[object]) -> None:
    if value not in choices:
        fail(op, arg, "one of " + ", ".join(repr(c) for c in choices), repr(value))


def check_positive(op: str, arg: str, value: object) -> None:
    if not isinstance(value, (int, float, torch.SymInt, torch.SymFloat)) or isinstance(value, bool):
        fail(op, arg, "a positive number", repr(value))
    if value <= 0:
        fail(op, arg, "a positive number", repr(value))
