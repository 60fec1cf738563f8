"""The triton backend's swa_attention / hca_attention / csa_attention (DeepSeek-V4's prefill
attentions: ragged tokens, each at its own position) against the reference ops.

The reference ops are checked against float64 loops in tests/ops/test_swa.py; here both run on
the same NaN-poisoned caches (a kernel reading past a window, an unclosed entry, a -1 page or
a -1 index shows NaN). CPU cases run Triton's interpreter on tiny shapes; the cuda cases add
V4-Flash's attention dims (64 heads of 512, window 128, CSA rate 4 with top-512, HCA rate 128,
pages of 64) with every token of several requests in one call, and a CUDA-graph capture.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import capture_cuda_graph
from tests.ops import test_swa as tiny
from tests.ops.triton.test_swa_decode import make_case

KINDS = ["swa", "hca", "csa"]


def args_of(kind, q, window_cache, comp, topk, sinks, positions, req_ids, table, window, rate, scale):
    if kind == "swa":
        return [q, window_cache, sinks, positions, req_ids, table, window, scale]
    if kind == "hca":
        return [q, window_cache, comp, sinks, positions, req_ids, table, window, rate, scale]
    return [q, window_cache, comp, topk, sinks, positions, req_ids, table, window, rate, scale]


def check(kind, args, device, *, atol=1e-5, rtol=1e-5):
    want_out, want_lse = getattr(torch.ops.mlagraph, f"{kind}_attention")(*args)
    moved = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    out, lse = getattr(torch.ops.mlagraph_triton, f"{kind}_attention")(*moved)
    assert out.dtype == args[0].dtype and out.shape == want_out.shape and lse.shape == want_lse.shape
    torch.testing.assert_close(out.cpu().float(), want_out.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(lse.cpu(), want_lse, atol=atol, rtol=rtol)
    return out.cpu(), lse.cpu()


def tiny_args(kind, page_size, rate, dtype=torch.float32):
    s = tiny.make_setup(page_size, rate)
    topk = tiny.make_topk(rate)
    return args_of(kind, s["q"].to(dtype), s["window"].to(dtype), s["compressed"].to(dtype), topk, s["sinks"],
                   s["positions"], s["req_ids"], s["table"], tiny.WINDOW, rate, tiny.SCALE)


# ---------------------------------------------------------------------------------------------
# tiny shapes (interpreter on CPU; compiled on cuda)


@pytest.mark.parametrize("page_size,rate", [(4, 2), (1, 2), (2, 4), (8, 8)])
@pytest.mark.parametrize("kind", KINDS)
def test_matches_reference(device, kind, page_size, rate):
    out, lse = check(kind, tiny_args(kind, page_size, rate), device)
    # the padding request's token (request 2: no pages) sees nothing: out 0, lse = its sink
    t = tiny.TOKENS.index((2, 0))
    sinks = tiny_args(kind, page_size, rate)[{"swa": 2, "hca": 3, "csa": 4}[kind]]
    assert torch.all(out[t] == 0)
    torch.testing.assert_close(lse[t], sinks)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", KINDS)
def test_half_precision(device, kind, dtype):
    check(kind, tiny_args(kind, 4, 2, dtype), device, atol=2e-2, rtol=2e-2)


def test_positions_int64_and_strided_queries(device):
    """int64 positions, and q a strided view (every other head of a wider tensor)."""
    args = tiny_args("hca", 4, 2)
    args[0] = torch.randn(args[0].shape[0], 2 * tiny.H, tiny.D)[:, ::2]
    args[4] = args[4].long()
    check("hca", args, device)


# ---------------------------------------------------------------------------------------------
# V4-Flash dims on the H200

FLASH = dict(heads=64, dim=512, page_size=64, window=128)


def flash_prefill(kind, seq_lens, dtype, seed):
    """Every position of every request as one ragged batch (requests interleaved), over the caches
    make_case fills; a padding token on the empty request."""
    rate, topk = {"swa": (4, 1), "hca": (128, 1), "csa": (4, 512)}[kind]
    case = make_case(kind, seq_lens=seq_lens, rate=rate, topk=topk, dtype=dtype, seed=seed, **FLASH)
    cache, comp = case[1], case[2]
    sinks, table = case[{"swa": 2, "hca": 3, "csa": 4}[kind]], case[{"swa": 3, "hca": 4, "csa": 5}[kind]]
    rows = [(b, p) for p in range(max(seq_lens)) for b, n in enumerate(seq_lens) if p < n]
    rows += [(b, 0) for b, n in enumerate(seq_lens) if n == 0]
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(rows), 64, 512, generator=g).to(dtype)
    positions = torch.tensor([p for _, p in rows], dtype=torch.int32)
    req_ids = torch.tensor([b for b, _ in rows], dtype=torch.int32)
    idx = torch.stack([torch.randperm(max(seq_lens) // 4 + 2, generator=g)[:topk] for _ in rows]).to(torch.int32)
    return args_of(kind, q, cache, comp if kind != "swa" else None, idx, sinks, positions, req_ids, table, 128, rate,
                   512**-0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_v4_flash_dims(kind, dtype):
    args = flash_prefill(kind, [700, 1, 0, 2100, 129], dtype, seed=11)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    check(kind, args, "cuda", **tol)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_cuda_graph_replay_follows_new_positions(kind):
    """Captured once; other positions and requests written into the same buffers replay right."""
    args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in flash_prefill(kind, [300, 40, 900], torch.bfloat16,
                                                                                   seed=12)]
    fn = getattr(torch.ops.mlagraph_triton, f"{kind}_attention")
    graph, (out, lse) = capture_cuda_graph(lambda: fn(*args))
    pos_i = {"swa": 3, "hca": 4, "csa": 5}[kind]
    positions, req_ids = args[pos_i], args[pos_i + 1]
    positions.copy_(torch.flip(positions, [0]))
    req_ids.copy_(torch.flip(req_ids, [0]))
    graph.replay()
    want_out, want_lse = getattr(torch.ops.mlagraph, f"{kind}_attention")(
        *[a.cpu() if isinstance(a, torch.Tensor) else a for a in args])
    torch.testing.assert_close(out.cpu().float(), want_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.cpu(), want_lse, atol=2e-2, rtol=2e-2)
