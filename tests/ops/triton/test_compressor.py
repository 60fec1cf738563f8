"""The triton backend's compressor_update against the reference op and a float64 formula.

Both ops run the same steps (prefill in one call, chunks, decode) on copies of the same
NaN-poisoned caches; after every step the state rows and the compressed entries must agree,
NaN for NaN: an entry the kernel writes too early, a row it writes to the wrong page or a slot
it reads through a -1 page shows. CPU cases run Triton's interpreter on tiny shapes; the cuda
cases add DeepSeek-V4-Flash's three compressors (CSA: 512 wide, rate 4, overlap; HCA: 512 wide,
rate 128; the CSA indexer's: 128 wide, rate 4, float32 keys; RoPE on the last 64 dims, pages
of 64) and a CUDA-graph capture of a decode step.
"""

from __future__ import annotations

import functools

import pytest
import torch

from mlagraph.ops import rope_cos_sin_cache, v4_layouts
from mlagraph.ops.triton import compressor as triton_compressor
from tests.helpers import capture_cuda_graph, make_block_table, slots_for
from tests.ops.test_compressor import ref_entries

EPS = 1e-6


def make_case(seq_lens, *, width, rope_dim, rate, overlap, page_size, entry_dtype=torch.float32,
              in_dtype=torch.float32, seed=0):
    """Per-request kv / gate rows, the weights and NaN-filled caches."""
    g = torch.Generator().manual_seed(seed)
    c = 2 if overlap else 1
    num_pages = sum(-(-n // page_size) for n in seq_lens) + 2
    table = make_block_table(seq_lens, page_size, num_pages, seed=seed, pad_pages=2)
    kv = [torch.randn(n, c * width, generator=g).to(in_dtype) for n in seq_lens]
    gate = [torch.randn(n, c * width, generator=g).to(in_dtype) for n in seq_lens]
    weights = dict(position_bias=torch.randn(rate, c * width, generator=g),
                   norm_weight=(torch.rand(width, generator=g) + 0.5).to(entry_dtype),
                   cos_sin=rope_cos_sin_cache(rope_dim, max(seq_lens) + 1, 10000.0))
    state = torch.full((num_pages, page_size, 2 * c * width), float("nan"))
    comp = torch.full((num_pages, v4_layouts.entries_per_page(page_size, rate), width), float("nan"),
                      dtype=entry_dtype)
    return dict(kv=kv, gate=gate, table=table, state=state, comp=comp, rate=rate, overlap=overlap,
                page_size=page_size, **weights)


def step_args(case, rows, device, *, pad=0):
    """The op's arguments for one step over ``rows`` [(request, position)], plus ``pad`` padding
    rows (slot -1, request 0, position 0) as the engine's static decode batch has."""
    pos = [p for _, p in rows] + [0] * pad
    req = [b for b, _ in rows] + [0] * pad
    slots = [slots_for(case["table"], case["page_size"], b, [p])[0] for b, p in rows] + [-1] * pad
    width = case["kv"][0].shape[1]
    kv = torch.stack([case["kv"][b][p] for b, p in rows] + [torch.zeros(width, dtype=case["kv"][0].dtype)] * pad)
    gate = torch.stack([case["gate"][b][p] for b, p in rows] + [torch.zeros(width, dtype=kv.dtype)] * pad)
    args = [kv, gate, case["position_bias"], case["norm_weight"], case["cos_sin"], torch.tensor(pos),
            torch.tensor(req, dtype=torch.int32), torch.tensor(slots), case["table"]]
    return [a.to(device) for a in args]


def schedule(seq_lens, chunk):
    """Steps of up to ``chunk`` tokens per request, requests interleaved in reverse (ragged)."""
    done, steps = [0] * len(seq_lens), []
    while any(d < n for d, n in zip(done, seq_lens)):
        rows = []
        for b in reversed(range(len(seq_lens))):
            take = min(chunk, seq_lens[b] - done[b])
            rows += [(b, p) for p in range(done[b], done[b] + take)]
            done[b] += take
        steps.append(rows)
    return steps


def run_both(case, steps, device, *, atol=1e-5, rtol=1e-5, pad=0, config=None):
    """Runs every step through both ops; compares the caches after each. Returns the triton
    op's caches (on the CPU). ``config`` (e.g. ``{"BLOCK_S": 4}``) calls the kernel's wrapper
    with that launch configuration instead of the registered op."""
    ours = torch.ops.mlagraph_triton.compressor_update
    if config is not None:
        ours = functools.partial(triton_compressor.compressor_update, config=config)
    ref_state, ref_comp = case["state"].clone(), case["comp"].clone()
    state, comp = case["state"].to(device), case["comp"].to(device)
    for rows in steps:
        args = step_args(case, rows, "cpu", pad=pad)
        tail = (case["rate"], case["overlap"], EPS)
        torch.ops.mlagraph.compressor_update(*args, ref_state, ref_comp, *tail)
        ours(*[a.to(device) for a in args], state, comp, *tail)
        torch.testing.assert_close(state.cpu(), ref_state, equal_nan=True, atol=0, rtol=0)
        torch.testing.assert_close(comp.cpu().float(), ref_comp.float(), equal_nan=True, atol=atol, rtol=rtol)
    return state.cpu(), comp.cpu()


def check_formula(case, seq_lens, comp, *, atol=1e-5, rtol=1e-5):
    rate, page = case["rate"], case["page_size"]
    for b, n in enumerate(seq_lens):
        want = ref_entries(case["kv"][b].float(), case["gate"][b].float(), case["position_bias"],
                           case["norm_weight"].float(), rate, case["overlap"], rope_dim=case["cos_sin"].shape[1])
        if n // rate:
            rows = v4_layouts.entry_slots(case["table"], torch.tensor(b), torch.arange(n // rate), page, rate)
            torch.testing.assert_close(comp.view(-1, comp.shape[-1])[rows].double(), want, atol=atol, rtol=rtol)


# ---------------------------------------------------------------------------------------------
# tiny shapes (interpreter on CPU; compiled on cuda)

SEQ_LENS = [9, 16, 3, 1]
TINY = dict(width=8, rope_dim=4)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("page_size,rate", [(4, 2), (4, 4), (2, 4), (8, 2), (1, 1)])
@pytest.mark.parametrize("chunk", [100, 3, 1])
def test_matches_reference_in_one_call_chunks_and_decode(device, overlap, page_size, rate, chunk):
    case = make_case(SEQ_LENS, rate=rate, overlap=overlap, page_size=page_size, **TINY)
    # ref_entries rotates with base 10000 over positions 0..63
    case["cos_sin"] = rope_cos_sin_cache(4, 64, 10000.0)
    _, comp = run_both(case, schedule(SEQ_LENS, chunk), device)
    check_formula(case, SEQ_LENS, comp)


@pytest.mark.parametrize("block_s", [None, 4, 1])
@pytest.mark.parametrize("overlap", [True, False])
def test_wide_entries_in_several_slot_blocks_and_padding_rows(device, overlap, block_s):
    """A 40-wide entry (padded to 64 lanes; RoPE on 16), rate 16, half precision inputs and a
    bf16 entry cache, and padding rows (slot -1) that must write nothing. The default walks a
    window's 16 (32) slots in one block; BLOCK_S 4 and 1 walk them in several, as HCA's 128
    slots of 512 features are walked on the GPU, so the online softmax's carry is exercised."""
    seq_lens = [40, 17, 33]
    case = make_case(seq_lens, width=40, rope_dim=16, rate=16, overlap=overlap, page_size=8,
                     entry_dtype=torch.bfloat16, in_dtype=torch.bfloat16, seed=2)
    config = None if block_s is None else {"BLOCK_S": block_s}
    run_both(case, schedule(seq_lens, 5), device, atol=1e-2, rtol=1e-2, pad=3, config=config)


def test_odd_width_runs_the_reference(device):
    """W - R odd (W = 7, R = 4): the rotated pairs do not start at an even feature, so the
    kernel's pairing does not apply and the op runs the reference."""
    seq_lens = [6, 4]
    case = make_case(seq_lens, width=7, rope_dim=4, rate=2, overlap=False, page_size=4, seed=3)
    run_both(case, schedule(seq_lens, 2), device)


def test_the_twin_checks_its_arguments(device):
    case = make_case([4], rate=2, overlap=True, page_size=4, **TINY)
    args = step_args(case, [(0, 0), (0, 1)], device)
    pages = case["state"].shape[0] + 1  # the compressed cache's page count then differs
    bad = torch.zeros(pages, *case["state"].shape[1:], device=device)
    with pytest.raises(ValueError, match="compressed_cache"):
        torch.ops.mlagraph_triton.compressor_update(*args, bad, case["comp"].to(device), 2, True, EPS)


# ---------------------------------------------------------------------------------------------
# V4-Flash's compressors on the H200

FLASH = {
    "csa": dict(width=512, rope_dim=64, rate=4, overlap=True, entry_dtype=torch.bfloat16),
    "hca": dict(width=512, rope_dim=64, rate=128, overlap=False, entry_dtype=torch.bfloat16),
    "indexer": dict(width=128, rope_dim=64, rate=4, overlap=True, entry_dtype=torch.float32),
}


@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(FLASH))
def test_gpu_v4_flash_prefill_then_decode(kind):
    seq_lens = [1000, 1, 257, 130, 513]
    case = make_case(seq_lens, page_size=64, in_dtype=torch.bfloat16, seed=5, **FLASH[kind])
    steps = [[(b, p) for b, n in enumerate(seq_lens) for p in range(n - 3)]]  # prefill all but 3
    steps += [[(b, n - k) for b, n in enumerate(seq_lens) if n >= k] for k in (3, 2, 1)]  # 3 decode steps
    _, comp = run_both(case, steps, "cuda", atol=2e-2, rtol=2e-2)
    check_formula(case, seq_lens, comp, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(FLASH))
def test_gpu_cuda_graph_decode_step(kind):
    """A decode step of 4 requests (one closing a window, padding rows included) captured once,
    then replayed with the next tokens' metadata written into the same buffers."""
    seq_lens = [520, 131, 64, 300]
    case = make_case(seq_lens, page_size=64, in_dtype=torch.bfloat16, seed=6, **FLASH[kind])
    ref_state, ref_comp = case["state"].clone(), case["comp"].clone()
    tail = (case["rate"], case["overlap"], EPS)
    prefill = step_args(case, [(b, p) for b, n in enumerate(seq_lens) for p in range(n - 2)], "cpu")
    torch.ops.mlagraph.compressor_update(*prefill, ref_state, ref_comp, *tail)
    state, comp = ref_state.cuda(), ref_comp.cuda()
    decode = [[(b, n - 2) for b, n in enumerate(seq_lens)], [(b, n - 1) for b, n in enumerate(seq_lens)]]
    static = step_args(case, decode[0], "cuda", pad=4)
    graph, _ = capture_cuda_graph(lambda: torch.ops.mlagraph_triton.compressor_update(*static, state, comp, *tail))
    # the capture's warm-up and capture ran step 0 (idempotent: same rows, same entries); replay step 1
    for rows in decode:
        for buf, new in zip(static, step_args(case, rows, "cuda", pad=4)):
            buf.copy_(new)
        graph.replay()
        torch.ops.mlagraph.compressor_update(*step_args(case, rows, "cpu", pad=4), ref_state, ref_comp, *tail)
    torch.testing.assert_close(state.cpu(), ref_state, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(comp.cpu().float(), ref_comp.float(), equal_nan=True, atol=2e-2, rtol=2e-2)
