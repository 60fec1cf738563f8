"""The triton backend's swa_decode / hca_decode / csa_decode against the reference ops and a
float64 formula.

Caches are NaN wherever nobody wrote, so a kernel that reads past a window, through a -1 page,
an entry not yet closed or a -1 index shows NaN. CPU cases run Triton's interpreter on tiny
shapes; the cuda cases add V4-Flash's attention dims (64 heads of 512, window 128, CSA rate 4
with top-512, HCA rate 128, page size 64; transformers' DeepseekV4Config defaults) and a
CUDA-graph capture.
"""

from __future__ import annotations

import math

import pytest
import torch

from mlagraph.ops import v4_layouts
from tests.helpers import capture_cuda_graph, make_block_table, slots_for

KINDS = ["swa", "hca", "csa"]
SEQ_LENS = [9, 0, 23, 2, 40]  # a padding request, a short one, ones past the window


def make_case(kind, *, seq_lens=SEQ_LENS, s_q=1, heads=3, dim=24, page_size=4, rate=2, window=6, topk=5,
              dtype=torch.float32, seed=0):
    """Random keys and entries per request in NaN-poisoned paged caches, queries and a top-k
    with -1s, not-yet-closed entries and (per query) distinct ids. Returns the op's args."""
    g = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-n // page_size) for n in seq_lens) + 3
    table = make_block_table(seq_lens, page_size, num_pages, seed=seed, pad_pages=2)
    cache = torch.full((num_pages, page_size, dim), float("nan"), dtype=dtype)
    comp = torch.full((num_pages, v4_layouts.entries_per_page(page_size, rate), dim), float("nan"), dtype=dtype)
    for b, n in enumerate(seq_lens):
        if n:
            cache.view(-1, dim)[slots_for(table, page_size, b, range(n))] = torch.randn(n, dim, generator=g).to(dtype)
        entries = torch.arange(n // rate)
        if len(entries):
            rows = v4_layouts.entry_slots(table, torch.tensor(b), entries, page_size, rate)
            comp.view(-1, dim)[rows] = torch.randn(len(entries), dim, generator=g).to(dtype)
    batch = len(seq_lens)
    q = torch.randn(batch, s_q, heads, dim, generator=g).to(dtype)
    sinks = torch.randn(heads, generator=g)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    max_entries = max(max(seq_lens) // rate + 2, topk)
    idx = torch.stack([torch.randperm(max_entries, generator=g)[:topk] for _ in range(batch * s_q)])
    idx = torch.where(torch.rand(idx.shape, generator=g) < 0.2, -1, idx).to(torch.int32).view(batch, s_q, topk)
    scale = dim**-0.5
    if kind == "swa":
        return [q, cache, sinks, table, lens, window, scale]
    if kind == "hca":
        return [q, cache, comp, sinks, table, lens, window, rate, scale]
    return [q, cache, comp, idx, sinks, table, lens, window, rate, scale]


def formula(kind, args):
    """float64 out [B, s_q, H, D], lse [B, s_q, H] straight from the definition."""
    if kind == "swa":
        q, cache, sinks, table, lens, window, scale = args
    elif kind == "hca":
        q, cache, comp, sinks, table, lens, window, rate, scale = args
    else:
        q, cache, comp, idx, sinks, table, lens, window, rate, scale = args
    page = cache.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.zeros(q.shape[:3], dtype=torch.float64)
    for b, n in enumerate(lens.tolist()):
        for i in range(q.shape[1]):
            pos = n - q.shape[1] + i
            keys = [cache[table[b, p // page], p % page] for p in range(max(0, pos - window + 1), pos + 1)]
            seen = range((pos + 1) // rate) if kind == "hca" else []
            if kind == "csa":
                seen = [e for e in idx[b, i].tolist() if e >= 0 and (e + 1) * rate <= pos + 1]
            for e in seen:
                keys.append(comp.view(-1, comp.shape[-1])[v4_layouts.entry_slots(table, torch.tensor(b),
                                                                                 torch.tensor(e), page, rate)])
            k = torch.stack(keys).double() if keys else torch.zeros(0, q.shape[-1], dtype=torch.float64)
            logits = torch.cat([q[b, i].double() @ k.T * scale, sinks.double()[:, None]], dim=1)
            lse[b, i] = torch.logsumexp(logits, dim=1)
            out[b, i] = torch.exp(logits[:, :-1] - lse[b, i][:, None]) @ k
    return out, lse


def op(kind, backend):
    return getattr(getattr(torch.ops, backend), f"{kind}_decode")


def on(device, args):
    return [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]


def check(kind, args, device, *, atol=1e-5, rtol=1e-5):
    want_out, want_lse = op(kind, "mlagraph")(*args)
    out, lse = op(kind, "mlagraph_triton")(*on(device, args))
    assert out.dtype == args[0].dtype and out.shape == want_out.shape and lse.shape == want_lse.shape
    torch.testing.assert_close(out.cpu().float(), want_out.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(lse.cpu(), want_lse, atol=atol, rtol=rtol)
    return out.cpu(), lse.cpu()


# ---------------------------------------------------------------------------------------------
# tiny shapes (interpreter on CPU; compiled on cuda)


@pytest.mark.parametrize("page_size,rate", [(4, 2), (1, 2), (2, 4), (8, 8)])
@pytest.mark.parametrize("s_q", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_matches_reference_and_formula(device, kind, s_q, page_size, rate):
    args = make_case(kind, s_q=s_q, page_size=page_size, rate=rate)
    out, lse = check(kind, args, device)
    want_out, want_lse = formula(kind, args)
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
    # the padding request sees nothing: out 0, lse = its sink
    assert torch.all(out[1] == 0)
    sinks = args[{"swa": 2, "hca": 3, "csa": 4}[kind]]
    torch.testing.assert_close(lse[1], sinks.expand(lse[1].shape))


@pytest.mark.parametrize("kind", KINDS)
def test_more_heads_than_a_block_and_power_of_two_dims(device, kind):
    """20 heads: two head blocks of 16, the second ragged; D = 32 (no padded columns)."""
    check(kind, make_case(kind, heads=20, dim=32, window=9, topk=8, seed=3), device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", KINDS)
def test_half_precision(device, kind, dtype):
    args = make_case(kind, dtype=dtype, seed=4)
    check(kind, args, device, atol=2e-2, rtol=2e-2)


def test_csa_duplicates_and_all_minus_one(device):
    """An entry listed twice counts twice (as in the reference); a query whose top-k is all -1
    attends its window only."""
    args = make_case("csa", seed=5)
    idx = args[3]
    idx[0, 0] = torch.tensor([0, 0, 1, -1, -1], dtype=torch.int32)
    idx[2, 0] = -1
    check("csa", args, device)


def test_window_longer_than_the_request_and_block_table_edge(device):
    """window 64 > every length; the longest request fills its block table exactly."""
    seq_lens = [16, 5]
    args = make_case("hca", seq_lens=seq_lens, page_size=4, rate=4, window=64)
    args[4] = args[4][:, :4].contiguous()  # 4 pages of 4: exactly the longest request
    check("hca", args, device)


# ---------------------------------------------------------------------------------------------
# V4-Flash dims on the H200

FLASH = dict(heads=64, dim=512, page_size=64, window=128)


@pytest.mark.gpu
@pytest.mark.parametrize("kind,rate,topk", [("swa", 4, 1), ("hca", 128, 1), ("csa", 4, 512)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_v4_flash_dims(kind, rate, topk, dtype):
    seq_lens = [4096, 1, 0, 777, 2300, 129, 128, 3000]
    args = make_case(kind, seq_lens=seq_lens, rate=rate, topk=topk, dtype=dtype, seed=7, **FLASH)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    check(kind, args, "cuda", **tol)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_batch_128_and_two_token_decode(kind):
    seq_lens = [(37 * b) % 4000 + 1 for b in range(128)]
    rate, topk = (128, 1) if kind == "hca" else (4, 512)
    args = make_case(kind, seq_lens=seq_lens, s_q=2, rate=rate, topk=topk, dtype=torch.bfloat16, seed=8, **FLASH)
    check(kind, args, "cuda", atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_cuda_graph_replay_follows_new_lengths(kind):
    """Captured once; new lengths (and top-k) written into the same buffers replay correctly."""
    rate, topk = (128, 1) if kind == "hca" else (4, 512)
    args = on("cuda", make_case(kind, seq_lens=[1000, 300, 2000, 5], rate=rate, topk=topk, dtype=torch.bfloat16,
                                seed=9, **FLASH))
    lens = args[-4 if kind != "swa" else -3]
    graph, (out, lse) = capture_cuda_graph(lambda: op(kind, "mlagraph_triton")(*args))
    lens.copy_(torch.tensor([900, 64, 1999, 0], dtype=torch.int32))
    graph.replay()
    want_out, want_lse = op(kind, "mlagraph")(*on("cpu", args))
    torch.testing.assert_close(out.cpu().float(), want_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.cpu(), want_lse, atol=2e-2, rtol=2e-2)
    assert math.isfinite(float(lse.abs().max()))
