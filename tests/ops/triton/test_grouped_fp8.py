"""mlagraph.ops.triton.grouped_fp8: the grouped GEMM over fp8 block-scaled experts that
mlagraph::moe runs on CUDA, against F.grouped_mm over the dequantized weights (CPU through
Triton's interpreter; CUDA under -m gpu), its tile schedule, and moe through it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mlagraph.ops.moe as moe_module
from mlagraph.ops.fp8 import dequantize_blockwise, quantize_blockwise
from mlagraph.ops.moe import moe_all_experts
from mlagraph.ops.triton.grouped_fp8 import grouped_fp8_mm, tile_schedule
from tests.helpers import NoHostSync, capture_cuda_graph
from tests.ops.test_moe import FP8_D, FP8_I, ROUTINGS, random_moe_args

E, N, K = 8, 272, 160  # ragged 128-blocks in both dims
COUNTS = [0, 5, 17, 0, 1, 0, 3, 14]  # empty experts, a single row, groups across tile edges


def _experts(device, experts=E, n=N, k=K):
    w, s = quantize_blockwise(torch.randn(experts, n, k, generator=torch.Generator().manual_seed(0)) * k**-0.5)
    return w.to(device), s.to(device)


@pytest.mark.parametrize("block_m", [1, 4, 16])
@pytest.mark.parametrize("counts", [COUNTS, [0] * 7 + [9], [3] * 8])
def test_tile_schedule_covers_every_row_once_within_its_expert(counts, block_m):
    offs = torch.tensor(counts).cumsum(0).int()
    rows = int(offs[-1])
    expert, row0, row_end = tile_schedule(offs, rows, block_m)
    assert expert.shape[0] == -(-rows // block_m) + min(len(counts), rows)  # the fixed grid extent
    starts = [0, *offs.tolist()[:-1]]
    covered = []
    for e, r0, end in zip(expert.tolist(), row0.tolist(), row_end.tolist()):
        if e == len(counts):
            continue  # an unused tile
        assert starts[e] <= r0 < end == offs[e].item()  # inside its expert's group
        covered += range(r0, min(r0 + block_m, end))
    assert sorted(covered) == list(range(rows))


def test_tile_schedule_reads_nothing_on_the_host():
    """The schedule is device math on the group ends: capturable, the grid fixed by shapes."""
    offs = torch.tensor(COUNTS).cumsum(0).int()
    with NoHostSync():
        expert, _, _ = tile_schedule(offs, 40, 16)
    assert expert.shape == (3 + 8,)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_grouped_fp8_mm_equals_grouped_mm_of_dequantized(device, dtype, tol):
    w, s = _experts(device)
    offs = torch.tensor(COUNTS, device=device).cumsum(0).int()
    x = torch.randn(int(offs[-1]), K + 8, device=device)[:, 4 : K + 4].to(dtype)  # non-contiguous rows
    got = grouped_fp8_mm(x, w, s, offs)
    deq = dequantize_blockwise(w, s, dtype)
    want = torch.cat([x[a:b].float() @ deq[e].float().T for e, (a, b) in
                      enumerate(zip([0, *offs.tolist()[:-1]], offs.tolist()))])
    assert got.dtype == dtype and got.shape == (x.shape[0], N)
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * want.abs().max().item())
    if dtype == torch.bfloat16 and device.type == "cuda":
        ref = F.grouped_mm(x.contiguous(), deq.transpose(1, 2), offs=offs)
        torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_fp8_experts_through_the_kernel_equal_the_reference(monkeypatch, device, dtype):
    """moe with fp8 experts: the Triton kernel path (CUDA's) equals the dequantizing one."""
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a
                 for a in random_moe_args(6, E, FP8_D, FP8_I, ROUTINGS[3], dtype, fp8=True))
    want = moe_all_experts(*args).float()
    monkeypatch.setattr(moe_module, "_fp8_kernel_runs", lambda hidden: True)
    got = torch.ops.mlagraph.moe(*args)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.gpu
def test_grouped_fp8_mm_captures_in_a_cuda_graph():
    w, s = _experts("cuda", experts=16, n=512, k=384)
    counts = torch.tensor([4, 0, 9, 1] * 4, device="cuda")
    offs = counts.cumsum(0).int()
    x = torch.randn(int(offs[-1]), 384, device="cuda").bfloat16()
    graph, out = capture_cuda_graph(lambda: grouped_fp8_mm(x, w, s, offs))
    x.copy_(torch.randn_like(x))
    offs.copy_(counts.roll(1).cumsum(0).int())  # other groups, same rows: replay follows them
    graph.replay()
    torch.testing.assert_close(out, grouped_fp8_mm(x, w, s, offs), rtol=0, atol=0)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_fp8_linear_cuda_kernel_decode_path_is_the_reference(dtype, tol):
    """fp8_linear's CUDA kernel at decode sizes runs this GEMM with one group; called here on
    CPU tensors (the interpreter), it equals the reference op."""
    from mlagraph.ops.fp8 import W8A16_MAX_ROWS, _fp8_linear_cuda

    q, s = quantize_blockwise(torch.randn(N, K) * K**-0.5)
    x = torch.randn(W8A16_MAX_ROWS, K).to(dtype)
    want = torch.ops.mlagraph.fp8_linear(x, q, s).float()
    torch.testing.assert_close(_fp8_linear_cuda(x, q, s).float(), want, rtol=tol, atol=tol * want.abs().max().item())


def test_quantized_activations_are_the_product_of_the_quantized_operands(device):
    """W8A8 (prefill): x quantized per 1x128 group, each block an e4m3 x e4m3 product scaled by
    both scales: the same as dequantized x times dequantized W, and within e4m3's rounding of
    the W8A16 result."""
    from mlagraph.ops.fp8 import quantize_1x128

    k = 256  # whole 128-groups
    w, s = _experts(device, k=k)
    offs = torch.tensor(COUNTS, device=device).cumsum(0).int()
    x = torch.randn(int(offs[-1]), k, device=device).bfloat16()
    got = grouped_fp8_mm(x, w, s, offs, quantize_activations=True).float()
    x8, xs = quantize_1x128(x)
    x_deq = (x8.float().view(-1, 2, 128) * xs[..., None]).view(-1, k)
    deq = dequantize_blockwise(w, s, torch.float32)
    ends = offs.tolist()
    want = torch.cat([x_deq[a:b] @ deq[e].T for e, (a, b) in enumerate(zip([0, *ends[:-1]], ends))])
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * want.abs().max().item())  # bf16 output
    w8a16 = grouped_fp8_mm(x, w, s, offs).float()
    assert ((got - w8a16).norm() / w8a16.norm()) < 5e-2


@pytest.mark.parametrize("block_k", [32, 64, 256])
def test_float_experts_take_other_k_steps(device, block_k):
    """Float experts (no scales) may step K by other powers of two than the fp8 scale block: the
    same grouped product, K ragged against every step."""
    from mlagraph.ops.triton.grouped_fp8 import grouped_float_mm

    w = torch.randn(E, N, K, generator=torch.Generator().manual_seed(1)).to(device) * K**-0.5
    offs = torch.tensor(COUNTS, device=device).cumsum(0).int()
    x = torch.randn(int(offs[-1]), K, device=device)
    # float32 tiles: 32 columns, 2 stages keep a 256-wide K step within shared memory
    got = grouped_float_mm(x, w, offs, config={"BLOCK_K": block_k, "BLOCK_N": 32, "num_stages": 2})
    want = torch.cat([x[a:b] @ w[e].T for e, (a, b) in enumerate(zip([0, *offs.tolist()[:-1]], offs.tolist()))])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_default_tile_of_16_bit_experts_at_decode_sizes():
    """bf16 / fp16 experts in 16-row tiles step K by 256 over 64 columns (the H100's moe_bw run:
    as fast over all experts, faster where the rows crowd a few); fp8 experts and float32 ones
    do not take it (fp8: one scale block a step)."""
    from mlagraph.ops.triton.grouped_fp8 import default_config, half_experts

    got = default_config(192, 64, 2816, "cuda", interpreter=False, half_experts=True)
    assert got == {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3, "PERSISTENT": 0}
    w, s = _experts("cpu")
    assert not half_experts(w, s) and not half_experts(torch.zeros(2, 2, 2), None)
    assert half_experts(torch.zeros(2, 2, 2, dtype=torch.bfloat16), None)


@pytest.mark.parametrize("block_k", [64, 96])
def test_fp8_experts_refuse_a_k_step_other_than_the_scale_block(block_k):
    w, s = _experts("cpu")
    offs = torch.tensor(COUNTS).cumsum(0).int()
    x = torch.randn(int(offs[-1]), K)
    match = "power of two" if block_k == 96 else "BLOCK_K must be 128"
    with pytest.raises(ValueError, match=match):
        grouped_fp8_mm(x, w, s, offs, config={"BLOCK_K": block_k})


@pytest.mark.parametrize("programs", [1, 3])
@pytest.mark.parametrize("kind", ["fp8", "fp8 activations", "float"])
def test_persistent_programs_compute_the_same_tiles(device, kind, programs):
    """PERSISTENT > 0: a fixed number of programs walk the (M tile, N tile) items with the item
    and K loops flattened; each item as the one-tile-a-program kernel computes it (equal
    bits), over empty experts, a single row and groups across tile edges, and for a program
    count that does not divide the items. The CPU interpreter has one SM: 1 or 3 programs."""
    from mlagraph.ops.triton.grouped_fp8 import grouped_float_mm

    k = 256 if kind == "fp8 activations" else K
    offs = torch.tensor(COUNTS, device=device).cumsum(0).int()
    x = torch.randn(int(offs[-1]), k, device=device)
    cfg = {"BLOCK_N": 32, "num_stages": 2}
    if kind == "float":
        w = torch.randn(E, N, k, generator=torch.Generator().manual_seed(1)).to(device) * k**-0.5
        run = lambda c: grouped_float_mm(x, w, offs, config=c)  # noqa: E731
    else:
        w, s = _experts(device, k=k)
        xb = x.bfloat16()
        run = lambda c: grouped_fp8_mm(xb, w, s, offs, quantize_activations=kind != "fp8", config=c)  # noqa: E731
    want = run(cfg)
    got = run({**cfg, "PERSISTENT": programs})
    assert torch.equal(got, want)


def test_persistent_refuses_a_bad_program_count():
    w, s = _experts("cpu")
    offs = torch.tensor(COUNTS).cumsum(0).int()
    with pytest.raises(ValueError, match="PERSISTENT must be an int >= 0"):
        grouped_fp8_mm(torch.randn(int(offs[-1]), K), w, s, offs, config={"PERSISTENT": -1})


def test_persistent_programs_read_rows_in_place_as_the_sorted_path_does(device):
    """As the sorted MoE path launches it: moe_sort's tile schedule and each sorted row reading
    its token's row of x in place (order, top_k), bf16 experts at the decode tile. The
    persistent kernel gives the one-tile kernel's bits."""
    from mlagraph.ops.triton.grouped_fp8 import config_for, run_tiles
    from mlagraph.ops.triton.moe_sort import sort_pairs

    g = torch.Generator().manual_seed(3)
    t, top_k, experts, n, k = 9, 3, 8, 96, 64
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(t)]).to(device)
    x = torch.randn(t, k, generator=g).to(device, torch.bfloat16)
    w = (torch.randn(experts, n, k, generator=g) * k**-0.5).to(device, torch.bfloat16)
    cfg = config_for(t * top_k, experts, n, x.device, {"BLOCK_N": 32, "BLOCK_K": 32, "num_stages": 2},
                     half_experts=True)
    sort = sort_pairs(ids, experts, cfg["BLOCK_M"])
    want = run_tiles(x, w, None, sort.schedule, t * top_k, cfg, order=sort.order, top_k=top_k)
    got = run_tiles(x, w, None, sort.schedule, t * top_k, {**cfg, "PERSISTENT": 2}, order=sort.order, top_k=top_k)
    assert torch.equal(got, want)
    pairs = x.float()[sort.order.long() // top_k]  # sorted row r is pair order[r]
    exact = torch.einsum("pk,pnk->pn", pairs, w.float()[ids.view(-1)[sort.order.long()]])
    torch.testing.assert_close(got.float(), exact, rtol=2e-2, atol=2e-2 * exact.abs().max().item())
