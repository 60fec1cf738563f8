"""mlagraph_triton::moe: the decode-sized pair kernels (mlagraph/ops/triton/moe.py) against the
all-experts oracle and a float64 loop, fp8 experts, expert shards, the switch to the grouped
path, opcheck and bad input (CPU through Triton's interpreter; CUDA under -m gpu)."""

from __future__ import annotations

import pytest
import torch

import mlagraph  # noqa: F401  (registers the ops)
import mlagraph.ops.triton  # noqa: F401  (registers mlagraph_triton.*)
from mlagraph.ops.fp8 import dequantize_blockwise
from mlagraph.ops.moe import moe_all_experts, route
from mlagraph.ops.triton import moe as triton_moe
from tests import helpers
from tests.helpers import NoHostSync, capture_cuda_graph
from tests.ops.test_moe import (FP8_D, FP8_I, ROUTINGS, loop_moe, loop_shared, random_moe_args, random_shared,
                                with_shared_args)

op = torch.ops.mlagraph_triton.moe
E, D, I = 8, 48, 40  # widths that are not multiples of the tiles
ROUTING_CASES = [ROUTINGS[0], ROUTINGS[1], ROUTINGS[3]]
ROUTING_IDS = [r[0] for r in ROUTING_CASES]


def _on(args, device):
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def pairs(args, first_expert=None):
    """The pair kernels on moe's arguments, whatever the batch size (the op may pick another path)."""
    weights, ids = route(args[1], *args[4:12])
    scales = args[12:14] if len(args) > 12 else (None, None)
    return triton_moe.routed_experts(args[0], weights, ids, args[2], args[3], *scales, first_expert)


def _spy(monkeypatch, *names):
    """Records (name, whether the shared experts came folded, as shared_out) per path call."""
    calls = []
    for name in names:
        real = getattr(triton_moe, name)

        def spy(*a, real=real, name=name, **k):
            calls.append((name, k.get("shared") is not None, k.get("shared_out") is not None))
            return real(*a, **k)

        monkeypatch.setattr(triton_moe, name, spy)
    return calls


def _rel(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.parametrize("num_tokens", [1, 2])  # 2 x 3 = 6 pairs, 0.75 an expert: the largest pair batch
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("routing", ROUTING_CASES, ids=ROUTING_IDS)
def test_pair_kernels_match_the_all_experts_oracle(device, routing, dtype, tol, num_tokens):
    args = _on(random_moe_args(num_tokens, E, D, I, routing, dtype), device)
    assert triton_moe.path_for(num_tokens, args[5], E, fp8=False) == "pairs"
    out = op(*args)
    assert out.dtype == dtype and out.shape == (num_tokens, D)
    assert _rel(out, moe_all_experts(*args)) < tol


def test_pair_kernels_match_a_float64_loop(device):
    args = _on(random_moe_args(4, E, D, I, ROUTINGS[3]), device)
    weights, ids = route(args[1], *args[4:12])
    want = loop_moe(*(a.cpu() for a in (args[0], args[2], args[3], weights, ids)))
    torch.testing.assert_close(pairs(args).cpu().double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_a_repeated_row_gives_the_row_alone(device):
    """The engine's batch-1 decode graph runs two rows, the second a copy of the first
    (torch.compile's size-1 special case): both rows equal the row run alone."""
    args = _on(random_moe_args(1, E, D, I, ROUTINGS[3], torch.bfloat16), device)
    twice = (args[0].repeat(2, 1), args[1].repeat(2, 1), *args[2:])
    alone, both = op(*args), op(*twice)
    assert triton_moe.path_for(2, args[5], E, fp8=False) == "pairs"
    torch.testing.assert_close(both, alone.repeat(2, 1), rtol=0, atol=0)


@pytest.mark.parametrize("fp8", [False, True], ids=["float", "fp8"])
# E = 8, top-3: 2 / 3 tokens straddle 0.75 pairs an expert (bf16 pairs -> sorted), 85 / 86 straddle
# 32 (sorted -> generic)
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 21, 85, 86])
def test_each_batch_size_takes_its_path(device, monkeypatch, num_tokens, fp8):
    """Pairs per expert (T * top_k / E) pick the path: the pair kernels up to
    PAIRS_PER_EXPERT_MAX, then our sorted path (one-launch sort, our grouped GEMM) up to
    TRITON_GROUPED_PER_EXPERT_MAX, then the generic op's grouped GEMMs behind our sort. Each
    equals the oracle."""
    calls = _spy(monkeypatch, "routed_experts", "grouped_triton", "sorted_generic")
    d, i = (FP8_D, FP8_I) if fp8 else (D, I)
    args = _on(random_moe_args(num_tokens, E, d, i, ROUTINGS[3], fp8=fp8), device)
    out = op(*args)
    per_expert = num_tokens * args[5] / E
    limit = triton_moe.PAIRS_PER_EXPERT_MAX["fp8" if fp8 else "bf16"]
    if per_expert <= limit or num_tokens * args[5] <= 1:
        want = ["routed_experts"]
    elif per_expert <= triton_moe.TRITON_GROUPED_PER_EXPERT_MAX:
        want = ["grouped_triton"]
    else:
        want = ["sorted_generic"]
    assert [name for name, _, _ in calls] == want
    assert triton_moe.path_for(num_tokens, args[5], E, fp8) == {"routed_experts": "pairs",
                                                                "grouped_triton": "triton_grouped",
                                                                "sorted_generic": "generic"}[want[0]]
    torch.testing.assert_close(out, moe_all_experts(*args), rtol=1e-5, atol=1e-5 * moe_all_experts(*args).abs().max().item())


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fp8_experts_equal_their_dequantized_weights(device, dtype, tol):
    """e4m3 experts with 128x128 block scales (ragged blocks: FP8_D, FP8_I are not multiples of
    128) compute with the weights their blocks stand for."""
    args = _on(random_moe_args(5, E, FP8_D, FP8_I, ROUTINGS[3], dtype, fp8=True), device)
    deq = (*args[:2], dequantize_blockwise(args[2], args[12], dtype), dequantize_blockwise(args[3], args[13], dtype),
           *args[4:12])
    out = pairs(args)
    if device.type == "cpu" and dtype == torch.bfloat16:
        # Triton's interpreter truncates float32 -> bfloat16 (the GPU rounds to nearest), and
        # the dequantized weights are rounded that way: a bias of ~2% here, none on the GPU.
        tol = 4e-2
    assert _rel(out, pairs(deq)) < tol
    assert _rel(out, moe_all_experts(*args)) < tol


@pytest.mark.parametrize("fp8", [False, True], ids=["float", "fp8"])
@pytest.mark.parametrize("ranks", [2, 4])
def test_expert_shards_sum_to_the_whole_layer(device, ranks, fp8):
    """Expert parallel: a pair whose expert is on another rank adds nothing; the shares sum
    (the pair kernels forced; the op itself, on whichever path, agrees)."""
    d, i = (FP8_D, FP8_I) if fp8 else (D, I)
    args = _on(random_moe_args(5, E, d, i, ROUTINGS[3], fp8=fp8), device)
    local = E // ranks
    shares = []
    for r in range(ranks):
        a = list(args)
        for j in (2, 3, 12, 13):
            if a[j] is not None:
                a[j] = a[j][r * local : (r + 1) * local].contiguous()
        shares.append(pairs(a, r * local))  # a rank no pair picked gets zeros
        torch.testing.assert_close(shares[-1], moe_all_experts(*a, r * local), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(op(*a, r * local), shares[-1], rtol=1e-5, atol=1e-5)  # whichever path it takes
    torch.testing.assert_close(sum(shares), pairs(args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("first_expert", [None, 4])
def test_sorted_generic_equals_the_generic_path(device, first_expert):
    """Prefill: our sort in place of torch's changes nothing downstream (same rows in the same
    order, same group ends, same GEMMs and glue): equal to the generic path bit for bit."""
    from mlagraph.ops import moe as generic
    from mlagraph.ops.triton import moe_glue

    args = list(_on(random_moe_args(90, E, D, I, ROUTINGS[3]), device))
    if first_expert is not None:
        args[2], args[3] = args[2][first_expert:].contiguous(), args[3][first_expert:].contiguous()
    weights, ids = route(args[1], *args[4:12])
    got = triton_moe.sorted_generic(args[0], weights, ids, args[2], args[3], None, None, E, first_expert)
    want = generic.routed_grouped(args[0], weights, ids, args[2], args[3], None, None, E, first_expert,
                                  activate=moe_glue.silu_mul, combine=moe_glue.unsort_combine)
    assert torch.equal(got, want)


@pytest.mark.parametrize("fp8", [False, True], ids=["float", "fp8"])
@pytest.mark.parametrize("num_tokens", [22, 40, 90])  # 90: past TRITON_GROUPED_PER_EXPERT_MAX
def test_grouped_paths_of_an_expert_shard(device, num_tokens, fp8):
    """Expert parallel on the sorted paths (our grouped GEMM, the generic one) with the fused
    glue: the rows of another rank's experts, which the GEMMs leave unwritten, add nothing."""
    d, i = (FP8_D, FP8_I) if fp8 else (D, I)
    args = _on(random_moe_args(num_tokens, E, d, i, ROUTINGS[3], fp8=fp8), device)
    assert triton_moe.path_for(num_tokens, args[5], E, fp8) != "pairs"
    a = list(args)
    for j in (2, 3, 12, 13):
        if a[j] is not None:
            a[j] = a[j][E // 2 :].contiguous()
    want = moe_all_experts(*a, E // 2)
    torch.testing.assert_close(op(*a, E // 2), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("num_tokens", [1, 3, 40])
def test_grouped_triton_gemm_matches_the_oracle(device, num_tokens):
    """The sorted path (one-launch sort, our Triton grouped GEMM) on float experts."""
    args = _on(random_moe_args(num_tokens, E, D, I, ROUTINGS[3]), device)
    got = triton_moe.grouped_triton(args[0], *route(args[1], *args[4:12]), args[2], args[3])
    assert _rel(got, moe_all_experts(*args)) < 1e-5


def test_no_host_sync(device):
    args = _on(random_moe_args(3, E, D, I, ROUTINGS[3]), device)
    op(*args)  # compile the kernels first
    with NoHostSync():
        op(*args)


def test_opcheck():
    helpers.opcheck(op, random_moe_args(3, E, D, I, ROUTINGS[0]))


def test_opcheck_fp8():
    helpers.opcheck(op, random_moe_args(3, E, FP8_D, FP8_I, ROUTINGS[3], fp8=True))


@pytest.mark.parametrize("arg,index,value", [
    ("top_k", 5, 9),  # more experts than the router scores
    ("router_logits", 1, torch.zeros(4, E)),  # another token count
    ("down_proj", 3, torch.zeros(E, D, I + 1)),
])
def test_bad_input_names_the_argument(arg, index, value):
    """The twin checks as the generic op does, eagerly and under fake tensors."""
    args = list(random_moe_args(3, E, D, I, ROUTINGS[0]))
    args[index] = value
    helpers.assert_value_error(op, tuple(args), helpers.arg_error(arg))


def test_tile_width_must_be_a_power_of_two():
    args = random_moe_args(2, E, FP8_D, FP8_I, ROUTINGS[3], fp8=True)
    weights, ids = route(args[1], *args[4:12])
    if not triton_moe.interpreted(triton_moe._gate_up_kernel):
        pytest.skip("the interpreter is off: the CPU tensors here cannot run")
    with pytest.raises(ValueError, match="BLOCK_K must be a power of 2, got 96"):
        triton_moe.routed_experts(args[0], weights, ids, args[2], args[3], args[12], args[13], None,
                                  config={"BLOCK_K": 96})


@pytest.mark.parametrize("block_k", [64, 128, 256])
def test_fp8_tiles_inside_and_across_scale_blocks(device, block_k):
    """fp8 tiles narrower than a 128-column scale block, one block, and two blocks side by side
    (one scale per row and block), over ragged blocks (FP8_D = 160, FP8_I = 136): equal to the
    dequantized weights' float32 result."""
    args = _on(random_moe_args(3, E, FP8_D, FP8_I, ROUTINGS[3], torch.float32, fp8=True), device)
    weights, ids = route(args[1], *args[4:12])
    deq = (*args[:2], dequantize_blockwise(args[2], args[12], torch.float32),
           dequantize_blockwise(args[3], args[13], torch.float32), *args[4:12])
    got = triton_moe.routed_experts(args[0], weights, ids, args[2], args[3], args[12], args[13], None,
                                    config={"BLOCK_K": block_k})
    assert _rel(got, pairs(deq)) < 1e-5


# --- shared experts in the same call ----------------------------------------------------------


# (fp8, D, I, I_s): shared widths of one partial chunk, two whole ones, and a ragged third;
# fp8 chunks of whole 128-column scale blocks (I = 128), and fp8 narrower than one routed expert
FOLD_CASES = [(False, D, I, 20), (False, D, I, 80), (False, D, I, 100),
              (True, FP8_D, 128, 256), (True, FP8_D, 128, 320), (True, FP8_D, FP8_I, 100)]
FOLD_IDS = [f"{'fp8' if c[0] else 'float'}-I{c[2]}-Is{c[3]}" for c in FOLD_CASES]


@pytest.mark.parametrize("num_tokens", [1, 2])
@pytest.mark.parametrize("fp8,d,i,i_s", FOLD_CASES, ids=FOLD_IDS)
def test_pair_kernels_fold_the_shared_experts(device, monkeypatch, fp8, d, i, i_s, num_tokens):
    """Decode: the shared MLP runs as ceil(I_s / I) extra program rows a token in the pair
    kernels (no GEMM of its own): equal to the generic op (routed + shared MLP) and to float64
    loops. fp8 needs 64 experts for the pair path at 2 tokens (at most 0.125 pairs an expert)."""
    experts = 64 if fp8 else E
    args = _on(random_moe_args(num_tokens, experts, d, i, ROUTINGS[3], fp8=fp8), device)
    shared = _on(random_shared(d, i_s, fp8=fp8), device)
    calls = _spy(monkeypatch, "routed_experts", "grouped_triton", "sorted_generic")
    out = op(*with_shared_args(args, shared))
    assert calls == [("routed_experts", True, False)]
    want = torch.ops.mlagraph.moe(*with_shared_args(args, shared))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    if not fp8:
        cpu = [a.cpu() for a in (args[0], args[2], args[3])]
        exact = loop_moe(*cpu, *(r.cpu() for r in route(args[1], *args[4:12]))) + loop_shared(
            cpu[0], *(w.cpu() for w in shared[:3]))
        torch.testing.assert_close(out.cpu().double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())


def test_shared_experts_that_cannot_fold_run_beside(device, monkeypatch):
    """fp8 shared experts wider than a routed expert whose width is not whole 128-blocks (136)
    cannot be cut into chunks of scale blocks: the pair kernels run the routed experts and the
    combine adds the shared MLP computed apart. Same result."""
    args = _on(random_moe_args(1, 32, FP8_D, FP8_I, ROUTINGS[3], fp8=True), device)
    shared = _on(random_shared(FP8_D, 2 * FP8_I, fp8=True), device)
    assert not triton_moe.shared_folds(shared, FP8_I, fp8=True)
    calls = _spy(monkeypatch, "routed_experts")
    out = op(*with_shared_args(args, shared))
    assert calls == [("routed_experts", False, True)]
    want = torch.ops.mlagraph.moe(*with_shared_args(args, shared))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("fp8", [False, True], ids=["float", "fp8"])
@pytest.mark.parametrize("num_tokens", [21, 86])  # our sorted path, the generic grouped one
def test_sorted_paths_add_the_shared_experts(device, monkeypatch, num_tokens, fp8):
    """Past decode sizes the shared MLP runs as three GEMMs and the routed path's combine adds
    it: equal to the generic op."""
    d, i = (FP8_D, FP8_I) if fp8 else (D, I)
    args = _on(random_moe_args(num_tokens, E, d, i, ROUTINGS[3], fp8=fp8), device)
    shared = _on(random_shared(d, 2 * i, fp8=fp8), device)
    calls = _spy(monkeypatch, "routed_experts", "grouped_triton", "sorted_generic")
    out = op(*with_shared_args(args, shared))
    assert len(calls) == 1 and calls[0][0] != "routed_experts" and calls[0][2]
    want = torch.ops.mlagraph.moe(*with_shared_args(args, shared))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("num_tokens", [1, 40])
def test_expert_shard_with_shared_slice(device, num_tokens):
    """Expert parallel with a rank's slice of the shared width, folded (1 token) or beside (40)."""
    args = _on(random_moe_args(num_tokens, E, D, I, ROUTINGS[3]), device)
    gate, up, down, *_ = _on(random_shared(D, 2 * I), device)
    a = list(args)
    a[2], a[3] = a[2][E // 2:].contiguous(), a[3][E // 2:].contiguous()
    shared = (gate[:I], up[:I], down[:, :I].contiguous(), None, None, None)
    want = torch.ops.mlagraph.moe(*with_shared_args(a, shared, E // 2))
    got = op(*with_shared_args(a, shared, E // 2))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("fp8", [False, True], ids=["float", "fp8"])
def test_opcheck_with_shared(fp8):
    d, i = (FP8_D, 128) if fp8 else (D, I)
    args = random_moe_args(1, 32, d, i, ROUTINGS[3], fp8=fp8)
    helpers.opcheck(op, with_shared_args(args, random_shared(d, 2 * i, fp8=fp8)))


def test_bad_shared_input_names_the_argument():
    args = random_moe_args(1, E, D, I, ROUTINGS[3])
    gate, up, down, *_ = random_shared(D, 2 * I)
    bad = with_shared_args(args, (gate, up[:, :-1], down, None, None, None))
    helpers.assert_value_error(op, bad, helpers.arg_error("shared_up_proj"))


# --- GPU: DeepSeek sizes, graphs ---------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("num_tokens", [1, 8])
def test_v3_dims_match_the_oracle(num_tokens, fp8, whole_gpu_memory):
    """DeepSeek-V3's MoE layer (256 experts of [2*2048, 7168], top-8) at decode sizes."""
    from benchmarks.common import V3_MOE, moe_layer_args

    args = moe_layer_args(num_tokens, device="cuda", fp8=fp8, **V3_MOE)
    want = moe_all_experts(*args)
    for out in (op(*args), pairs(args)):  # the op's path, and the pair kernels forced
        assert out.dtype == torch.bfloat16 and _rel(out, want) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_cuda_graph_capture(fp8):
    """The op, the pair kernels and (float experts) the sorted path, each captured once and
    replayed on new tokens and routes: equal to an eager call."""
    args = _on(random_moe_args(2, E, FP8_D, FP8_I, ROUTINGS[3], torch.bfloat16, fp8=fp8), "cuda")
    for fn in (lambda: op(*args), lambda: pairs(args), lambda: triton_moe.grouped_triton(
            args[0], *route(args[1], *args[4:12]), args[2], args[3]) if not fp8 else pairs(args)):
        graph, out = capture_cuda_graph(fn)
        args[0].copy_(torch.randn_like(args[0]))
        args[1].copy_(torch.randn_like(args[1]))
        graph.replay()
        torch.testing.assert_close(out, fn(), rtol=0, atol=0)
        assert _rel(out, moe_all_experts(*args)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_cuda_graph_capture_with_shared(fp8):
    """The pair kernels with the shared experts folded, captured and replayed on new tokens."""
    d, i = (FP8_D, 128) if fp8 else (FP8_D, FP8_I)
    args = _on(random_moe_args(1, 32, d, i, ROUTINGS[3], torch.bfloat16, fp8=fp8), "cuda")
    shared = _on(random_shared(d, 2 * i, torch.bfloat16, fp8=fp8), "cuda")
    call = with_shared_args(args, shared)
    graph, out = capture_cuda_graph(lambda: op(*call))
    args[0].copy_(torch.randn_like(args[0]))
    args[1].copy_(torch.randn_like(args[1]))
    graph.replay()
    torch.testing.assert_close(out, op(*call), rtol=0, atol=0)
    want = torch.ops.mlagraph.moe(*call)
    assert _rel(out, want) < 1e-2
