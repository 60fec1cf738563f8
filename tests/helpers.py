"""Small utilities shared by the op tests: paged block tables and bad-input checks."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Sequence

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from mlagraph.ops._define import op_bodies


def make_block_table(
    seq_lens: Sequence[int], page_size: int, num_pages: int, *, seed: int = 0, pad_pages: int = 1
) -> torch.Tensor:
    """A block table [B, max_pages] (int32) giving each request distinct, shuffled pages.

    Unused entries are -1; ``pad_pages`` extra columns make sure readers never rely on the
    table being exactly as wide as the longest request.
    """
    g = torch.Generator().manual_seed(seed)
    need = [(n + page_size - 1) // page_size for n in seq_lens]
    if sum(need) > num_pages:
        raise ValueError(f"need {sum(need)} pages, have {num_pages}")
    perm = torch.randperm(num_pages, generator=g).tolist()
    width = max(need, default=0) + pad_pages
    table = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    return table


def slots_for(block_table: torch.Tensor, page_size: int, req: int, positions: Sequence[int]) -> list[int]:
    """Cache slots of the given token positions of request ``req``."""
    return [int(block_table[req, p // page_size]) * page_size + p % page_size for p in positions]


def assert_value_error(fn: Callable, args: Sequence, match: str, kwargs: dict | None = None) -> None:
    """The call raises ValueError matching ``match`` eagerly AND under FakeTensorMode."""
    kwargs = kwargs or {}
    with pytest.raises(ValueError, match=match):
        fn(*args, **kwargs)
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake_kwargs = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        with pytest.raises(ValueError, match=match):
            fn(*fake_args, **fake_kwargs)


def arg_error(arg: str) -> str:
    """Regex for our error messages about argument ``arg``."""
    return re.escape(f"argument '{arg}'")


@contextlib.contextmanager
def _fp8_aware_allclose():
    """opcheck's test_schema compares every tensor argument before and after the call with
    torch.allclose, which has no CPU kernel for float8 (the "fp8" cache layout). Inside this
    context float8 tensors compare bit for bit instead, which is what that check means."""
    allclose = torch.allclose

    def fp8_aware(a, b, *args, **kwargs):
        if a.dtype == torch.float8_e4m3fn and b.dtype == torch.float8_e4m3fn:
            return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        return allclose(a, b, *args, **kwargs)

    torch.allclose = fp8_aware
    try:
        yield
    finally:
        torch.allclose = allclose


def opcheck(op, args, kwargs=None) -> None:
    """torch.library.opcheck with all four default checks, float8 arguments included."""
    with _fp8_aware_allclose():
        torch.library.opcheck(op, args, kwargs)


_SYNC_OPS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.item.default,
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
    torch.ops.aten.unique_consecutive.default,
    torch.ops.aten._unique2.default,
    torch.ops.aten.equal.default,
    torch.ops.aten.is_nonzero.default,
}


class NoHostSync(TorchDispatchMode):
    """Fails on any op that reads device data on the host (``.item()``, ``.tolist()``, nonzero,
    boolean masks, device->CPU copies) — also INSIDE mlagraph's custom ops, whose Python bodies
    it re-enters under itself. A step that passes is capturable in a CUDA graph."""

    def __init__(self):
        super().__init__()
        self.bodies = op_bodies()
        self.ops_seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SYNC_OPS:
            raise AssertionError(f"host sync: {func}")
        if func in (torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default):
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None):
                raise AssertionError(f"host sync: boolean-mask indexing via {func}")
        if func is torch.ops.aten._to_copy.default and kwargs.get("device") is not None:
            src = args[0].device
            if torch.device(kwargs["device"]).type == "cpu" and src.type != "cpu":
                raise AssertionError(f"host sync: device -> cpu copy via {func}")
        name = func._schema.name
        if name in self.bodies:
            self.ops_seen.append(name)
            with self:
                return self.bodies[name](*args, **kwargs)
        return func(*args, **kwargs)


def capture_cuda_graph(step: Callable):
    """Runs ``step()`` once on a side stream (kernels compile, the allocator settles), then
    captures one call in a CUDA graph. Returns (graph, the captured call's outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def sm90_build_report(code: str) -> list:
    """Runs ``code`` in a child Python without TRITON_INTERPRET (Gluon cannot compile the
    interpreter's functions, which this process's conftest turns on) and returns the JSON list
    its last stdout line prints: how the tests build Gluon kernels for sm_90 with no GPU."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().split("\n")[-1])
