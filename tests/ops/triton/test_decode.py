"""The triton backend's mla_decode against the reference op (mlagraph::mla_decode on CPU).

Caches are written with the layouts helpers into a cache whose unwritten rows are NaN (all-ones
bytes for fp8_ds), as tests/ops/test_decode.py's build_cache does but for any L and R, so a read
past a request's length, through a wrong page or through a -1 page poisons the output. CPU cases run Triton's interpreter on tiny shapes (L=128, R=32); the cuda
cases add DeepSeek-V3 sizes (L=512, R=64, H=16 and 128, page_size 64, lengths up to ~3000) and a
CUDA-graph capture and replay.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from mlagraph.ops import layouts
from tests import helpers
from tests.helpers import arg_error, assert_value_error, capture_cuda_graph, make_block_table, slots_for
from tests.ops.test_decode import CACHE_KINDS, FP8_SCALE, SM_SCALE

triton_decode = torch.ops.mlagraph_triton.mla_decode
ref_decode = torch.ops.mlagraph.mla_decode

L, R, H = 128, 32, 3  # tiny shapes for the interpreter (fp8_ds needs L divisible by 128)
# SM_SCALE, FP8_SCALE and the cache kinds are the reference op tests' (tests/ops/test_decode.py).
SEQ_LENS = [5, 0, 19, 1, 36]  # a padding request, a one-token one, ones longer than a split
SPLIT = {"BLOCK_N": 16, "MAX_SPLITS": 3}  # tiny blocks: requests of 36 keys span all 3 splits


def kernels():
    """The kernel module (imported lazily, after conftest has set TRITON_INTERPRET)."""
    return importlib.import_module("mlagraph.ops.triton.decode")


def make_cache(kind, seq_lens, page_size, *, latent=L, rope=R, seed=0, table=None, num_pages=None):
    """Random latents for positions 0..n-1 of every request, written into a NaN-poisoned paged
    cache. Returns (cache, scale, block_table); pass ``table`` and ``num_pages`` to refill a cache
    laid out like an earlier one."""
    layout, model_dtype = CACHE_KINDS[kind]
    if table is None:
        num_pages = sum(-(-n // page_size) for n in seq_lens) + 3  # a few never-used pages
        table = make_block_table(seq_lens, page_size, num_pages, seed=seed, pad_pages=2)
    shape = (num_pages, page_size, layouts.latent_row_width(layout, latent, rope))
    dtype = layouts.latent_storage_dtype(layout, model_dtype)
    if dtype == torch.uint8:
        cache = torch.full(shape, 255, dtype=torch.uint8)
    else:
        cache = torch.full(shape, float("nan")).to(dtype)
    scale = torch.tensor([FP8_SCALE]) if layout == "fp8" else None
    g = torch.Generator().manual_seed(seed)
    for b, n in enumerate(seq_lens):
        if n:
            kv_c = torch.randn(n, latent, generator=g).to(model_dtype)
            k_pe = torch.randn(n, rope, generator=g).to(model_dtype)
            rows = layouts.quantize_latent(layout, kv_c, k_pe, scale, cache.dtype)
            layouts.scatter_rows(cache, torch.tensor(slots_for(table, page_size, b, range(n))), rows)
    return cache, scale, table


def make_q(batch, s_q, heads, *, latent=L, rope=R, dtype=torch.float32, seed=1):
    """q_nope and q_pe as non-contiguous slices of one tensor, as the model makes them."""
    q = torch.randn(batch, s_q, heads, latent + rope, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return q[..., :latent], q[..., latent:]


def decode_args(kind, seq_lens, s_q, page_size, *, heads=H, latent=L, rope=R, q_dtype=torch.float32, seed=0):
    cache, scale, table = make_cache(kind, seq_lens, page_size, latent=latent, rope=rope, seed=seed)
    q_nope, q_pe = make_q(len(seq_lens), s_q, heads, latent=latent, rope=rope, dtype=q_dtype, seed=seed + 1)
    return [q_nope, q_pe, cache, table, torch.tensor(seq_lens, dtype=torch.int32), scale, CACHE_KINDS[kind][0],
            SM_SCALE]


def on(device, args):
    return [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]


def run(args, device, config=None):
    """The triton op (default config) or the kernel module with a config override, on ``device``;
    outputs back on CPU."""
    dev_args = on(device, args)
    if config is None:
        out, lse = triton_decode(*dev_args)
    else:
        out, lse = kernels().mla_decode_with_config(*dev_args, config=config)
    assert out.is_contiguous() and lse.is_contiguous()
    return out.cpu(), lse.cpu()


BF16_TOL = {"atol": 3e-2, "rtol": 2e-2}  # bf16 dots: p, out (and fp8_ds's dequantized rows) in bf16


def check(args, device, *, config=None, atol=1e-4, rtol=1e-4):
    """Runs the kernel and compares with the reference op on CPU; returns (out, lse)."""
    want_out, want_lse = ref_decode(*args)
    out, lse = run(args, device, config)
    assert out.dtype == args[0].dtype and lse.dtype == torch.float32
    assert out.shape == want_out.shape and lse.shape == want_lse.shape
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))  # same queries see no key
    torch.testing.assert_close(out.float(), want_out.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(lse, want_lse, atol=min(atol, 2e-2), rtol=rtol)
    return out, lse


def assert_padding(out, lse, seq_lens, s_q):
    """A query at position < 0 (all of a padding request's) sees no key: out 0, lse -inf."""
    for b, n in enumerate(seq_lens):
        for i in range(s_q):
            if n - s_q + i < 0:
                assert torch.all(out[b, i] == 0) and torch.all(lse[b, i] == -math.inf)


# ---------------------------------------------------------------------------------------------
# tiny shapes (interpreter on CPU; compiled on cuda)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("s_q", [1, 3])
@pytest.mark.parametrize("kind", list(CACHE_KINDS))
def test_matches_reference_split(device, kind, s_q, page_size):
    args = decode_args(kind, SEQ_LENS, s_q, page_size)
    out, lse = check(args, device, config=SPLIT)
    assert_padding(out, lse, SEQ_LENS, s_q)


@pytest.mark.parametrize("kind", list(CACHE_KINDS))
def test_matches_reference_default_config(device, kind):
    # Through the op: the heuristic's config (one split at these sizes: out written directly).
    args = decode_args(kind, SEQ_LENS, 2, 16)
    out, lse = check(args, device)
    assert_padding(out, lse, SEQ_LENS, 2)


@pytest.mark.parametrize("kind", ["bf16", "fp8_ds"])
@pytest.mark.parametrize("config", [None, SPLIT], ids=["direct", "split"])
def test_bf16_queries(device, kind, config):
    args = decode_args(kind, SEQ_LENS, 3, 4, q_dtype=torch.bfloat16)
    check(args, device, config=config, **BF16_TOL)


KEYS = {"FORM": "keys", "BLOCK_N": 16, "MAX_SPLITS": 3}  # keys-major, every block gathered
KEYS_TMA = {**KEYS, "TMA": True}  # whole blocks through tensor descriptors, the tail gathered


def keys_dims(kind, config):
    """fp8_ds rows are 16-byte aligned (as the copy engine needs) at DeepSeek's 512 + 64 only."""
    return (512, 64) if kind == "fp8_ds" and config.get("TMA") else (L, R)


@pytest.mark.parametrize("config", [KEYS, KEYS_TMA], ids=["keys", "keys_tma"])
@pytest.mark.parametrize("s_q", [1, 3])
@pytest.mark.parametrize("kind", list(CACHE_KINDS))
def test_keys_major_matches_reference(device, kind, s_q, config):
    latent, rope = keys_dims(kind, config)
    args = decode_args(kind, SEQ_LENS, s_q, 16, latent=latent, rope=rope)
    out, lse = check(args, device, config=config)
    assert_padding(out, lse, SEQ_LENS, s_q)


@pytest.mark.parametrize("config", [KEYS, {**KEYS_TMA, "MAX_SPLITS": 1}], ids=["keys", "keys_tma_direct"])
@pytest.mark.parametrize("kind", ["bf16", "fp8_ds"])
def test_keys_major_bf16_queries(device, kind, config):
    latent, rope = keys_dims(kind, config)
    check(decode_args(kind, SEQ_LENS, 2, 16, latent=latent, rope=rope, q_dtype=torch.bfloat16), device,
          config=config, **BF16_TOL)


@pytest.mark.parametrize("config", [KEYS, KEYS_TMA], ids=["keys", "keys_tma"])
def test_keys_major_missing_pages(device, config):
    """A -1 page in a whole block (the copy engine reads it out of bounds: zeros, then masked) and
    in a partial one (gathered), and a length past the table's capacity."""
    args = decode_args("bf16-f32", [5, 0, 48, 1, 36], 2, 16)
    table = args[3]
    table[2, 0] = -1  # request 2 loses keys 0..15 (a whole block)
    table[4, 2] = -1  # request 4 loses keys 32..35 (its partial last block)
    check(args, device, config=config)
    args[4] = torch.tensor([5, 0, table.shape[1] * 16 + 7, 1, 36], dtype=torch.int32)  # -1 pages past key 47
    check(args, device, config=config)


@pytest.mark.parametrize("s_q", [1, 2])
@pytest.mark.parametrize("kind", ["bf16-f32", "bf16"])
def test_keys_major_tma_tail_in_pieces(device, kind, s_q):
    """The TMA form gathers a split's partial block in 16-key pieces: tails of 19, 4 and 31 keys
    (two pieces, the second partial; one partial piece; two), the last behind a -1 page."""
    lens = [5, 0, 19, 1, 36, 63]
    args = decode_args(kind, lens, s_q, 32)
    args[3][5, 1] = -1  # request 5 loses keys 32..62: its whole tail, both pieces
    config = {**KEYS_TMA, "BLOCK_N": 32, "MAX_SPLITS": 1}
    out, lse = check(args, device, config=config)
    assert_padding(out, lse, lens, s_q)


def test_keys_major_tma_refusals():
    """TMA asked for where the copy engine cannot take a block whole: a clear error, nothing run."""
    args = decode_args("bf16-f32", [3, 0, 9], 1, 4)  # page 4 < BLOCK_N 16
    with pytest.raises(ValueError, match="page_size 4 is not a multiple of BLOCK_N 16"):
        kernels().mla_decode_with_config(*args, config=KEYS_TMA)
    args = decode_args("fp8_ds", [3, 0, 9], 1, 16)  # 128 + 4 + 64 bytes a row
    with pytest.raises(ValueError, match="16-byte aligned"):
        kernels().mla_decode_with_config(*args, config=KEYS_TMA)
    args = decode_args("bf16-f32", [3, 0, 9], 1, 16, latent=96, rope=8)
    with pytest.raises(ValueError, match="not powers of two"):
        kernels().mla_decode_with_config(*args, config=KEYS_TMA)
    with pytest.raises(ValueError, match="TMA needs FORM 'keys'"):
        kernels().mla_decode_with_config(*args, config={"TMA": True})
    with pytest.raises(ValueError, match="TMA needs num_stages >= 2, got 1"):
        kernels().mla_decode_with_config(*args, config={**KEYS_TMA, "num_stages": 1})
    with pytest.raises(ValueError, match="FORM must be 'rows', 'keys' or 'wgmma'"):
        kernels().mla_decode_with_config(*args, config={"FORM": "cols"})


def test_keys_major_non_contiguous_cache(device):
    """A cache whose pages are not back to back: the gathered keys-major form reads it in place."""
    args = decode_args("bf16-f32", SEQ_LENS, 2, 16)
    want = run(args, device, KEYS)
    dev_args = on(device, args)
    cache = dev_args[2]
    both = torch.full((cache.shape[0], 2, *cache.shape[1:]), float("nan"), dtype=cache.dtype, device=device)
    both[:, 1] = cache
    dev_args[2] = both[:, 1]
    got = kernels().mla_decode_with_config(*dev_args, config=KEYS)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
    with pytest.raises(ValueError, match="pages are not back to back"):
        kernels().mla_decode_with_config(*dev_args, config=KEYS_TMA)


def test_missing_pages_and_lengths_past_the_table(device):
    """A -1 page inside a request's length is never read (its keys are skipped, as in the
    reference); a length past the table's capacity reads only the keys the table holds."""
    args = decode_args("bf16-f32", SEQ_LENS, 2, 4)
    table = args[3]
    table[2, 1] = -1  # request 2 (19 keys) loses keys 4..7
    args[4] = torch.tensor([5, 0, 19, 1, table.shape[1] * 4 + 5], dtype=torch.int32)
    check(args, device, config=SPLIT)
    check(args, device)


def test_non_contiguous_cache_and_metadata(device):
    args = decode_args("fp8_ds", SEQ_LENS, 3, 16)
    want = run(args, device, SPLIT)
    dev_args = on(device, args)
    cache, table, seq_lens = dev_args[2:5]
    # A layer's cache as a view into an interleaved [pages, layers, page_size, W] allocation.
    both = torch.full((cache.shape[0], 2, *cache.shape[1:]), 255, dtype=torch.uint8, device=device)
    both[:, 1] = cache
    dev_args[2:5] = both[:, 1], table.t().contiguous().t(), torch.stack([seq_lens, seq_lens], dim=1)[:, 0]
    assert not any(a.is_contiguous() for a in dev_args[2:5])
    got = kernels().mla_decode_with_config(*dev_args, config=SPLIT)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


# ---------------------------------------------------------------------------------------------
# DeepSeek-V3 sizes (cuda only)

DS_L, DS_R, DS_PAGE = 512, 64, 64
DS_LENS = [2900, 0, 1, 700, 3001, 64, 129]


# These sizes would take the CPU interpreter minutes: the device fixture's cuda param only.
cuda_only = pytest.mark.parametrize("device", [pytest.param("cuda", marks=pytest.mark.gpu)], indirect=True)


@cuda_only
@pytest.mark.parametrize("config", [None, {"MAX_SPLITS": 1}], ids=["default", "one_split"])
@pytest.mark.parametrize("s_q", [1, 2])
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("kind", ["bf16", "fp8", "fp8_ds"])
def test_deepseek_shapes(device, kind, heads, s_q, config):
    args = decode_args(kind, DS_LENS, s_q, DS_PAGE, heads=heads, latent=DS_L, rope=DS_R, q_dtype=torch.bfloat16)
    out, lse = check(args, device, config=config, **BF16_TOL)
    assert_padding(out, lse, DS_LENS, s_q)


GPU_KEYS = {"FORM": "keys", "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}


@cuda_only
@pytest.mark.parametrize("config", [GPU_KEYS, {**GPU_KEYS, "TMA": True}, {**GPU_KEYS, "TMA": True, "MAX_SPLITS": 1},
                                    {**GPU_KEYS, "TMA": True, "BLOCK_N": 32, "num_warps": 4, "num_stages": 4},
                                    {**GPU_KEYS, "TMA": True, "num_warps": 4, "MAX_SPLITS": 2}],
                         ids=["keys", "keys_tma", "keys_tma_direct", "keys_tma_32", "keys_tma_4warps"])
@pytest.mark.parametrize("s_q", [1, 2])
@pytest.mark.parametrize("kind", ["bf16", "fp8", "fp8_ds"])
def test_deepseek_shapes_keys_major(device, kind, s_q, config):
    args = decode_args(kind, DS_LENS, s_q, DS_PAGE, heads=16, latent=DS_L, rope=DS_R, q_dtype=torch.bfloat16)
    table = args[3]
    table[0, 3] = -1  # a -1 page inside request 0's whole blocks
    out, lse = check(args, device, config=config, **BF16_TOL)
    assert_padding(out, lse, DS_LENS, s_q)


WS = {"FORM": "keys", "TMA": True, "WS": True}  # the keys form's Gluon twin (decode_stream)


@cuda_only
@pytest.mark.parametrize("config", [WS, {**WS, "MAX_SPLITS": 1}, {**WS, "MAX_SPLITS": 3}, {**WS, "BLOCK_H": 16},
                                    {**WS, "num_stages": 2}],
                         ids=["ws", "ws_direct", "ws_splits3", "ws_rows16", "ws_two_slots"])
@pytest.mark.parametrize("s_q", [1, 2])
@pytest.mark.parametrize("heads", [1, 8, 16])
@pytest.mark.parametrize("kind", ["bf16", "fp8", "fp8_ds"])
def test_deepseek_shapes_stream(device, kind, heads, s_q, config):
    """The Gluon keys form with its loader warp, on Hopper, every cache layout (the fp8 ones
    widened to fp16 tiles in shared memory): partial last blocks, a block of exactly 64, a
    padding and a one-token request, a -1 page among request 0's whole blocks, split boundaries,
    (rows16 at 16 heads, s_q 2) two row blocks a request, two slots where three fit."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon forms are sm_90 only")
    args = decode_args(kind, DS_LENS, s_q, DS_PAGE, heads=heads, latent=DS_L, rope=DS_R, q_dtype=torch.bfloat16)
    args[3][0, 3] = -1
    out, lse = check(args, device, config=config, **BF16_TOL)
    assert_padding(out, lse, DS_LENS, s_q)


@pytest.mark.parametrize("layout,rows,stages,fits", [("bf16", 16, 2, True), ("bf16", 16, 3, False),
                                                     ("fp8", 32, 3, True), ("fp8_ds", 16, 3, True),
                                                     ("fp8_ds", 32, 3, False), ("fp8_ds", 32, 1, False)])
def test_stream_slots_checked(layout, rows, stages, fits):
    """The Gluon keys form's slots against an SM's shared memory (what the sm_90 builds take is
    checked against the same bound in test_stream_kernel_builds_for_sm90); the default picks the
    most that fit."""
    decode_stream = importlib.import_module("mlagraph.ops.triton.decode_stream")
    if fits:
        decode_stream.check_stages(rows, 512, 64, layout, stages)
    else:
        with pytest.raises(ValueError, match=rf"WS needs num_stages >= 2 .*got {stages} \(\d+ B for {rows} rows"):
            decode_stream.check_stages(rows, 512, 64, layout, stages)
    two_slots = layout == "bf16" or (layout, rows) == ("fp8_ds", 32)
    assert decode_stream.pick_stages(rows, 512, 64, layout) == (2 if two_slots else 3)


KEYS_ROWS = {**GPU_KEYS, "TMA": True, "num_warps": 4}
HEAD_COUNT_CASES = [("bf16", None), ("fp8_ds", None), ("bf16", {**KEYS_ROWS, "BLOCK_H": 16}),
                    ("bf16", {**KEYS_ROWS, "BLOCK_H": 32})]  # the keys-major TMA form reads bf16 caches


@cuda_only
@pytest.mark.parametrize("kind,config", HEAD_COUNT_CASES, ids=["bf16", "fp8_ds", "keys_rows16", "keys_rows32"])
@pytest.mark.parametrize("heads", [1, 8, 24, 40, 64])
def test_tensor_parallel_head_counts(device, kind, config, heads):
    """A tensor-parallel shard's head counts (8, 24, 64 of 128; 1 and 40 for counts no library
    takes unpadded) at DeepSeek's widths, by default and in keys-major row blocks of 16 / 32
    (several blocks a request, the last one partial)."""
    args = decode_args(kind, DS_LENS, 1, DS_PAGE, heads=heads, latent=DS_L, rope=DS_R, q_dtype=torch.bfloat16)
    out, lse = check(args, device, config=config, **BF16_TOL)
    assert_padding(out, lse, DS_LENS, 1)


@cuda_only
@pytest.mark.parametrize("heads", [16, 128], ids=["keys_form", "gluon_form"])
def test_cuda_graph_replay_matches_eager(device, heads):
    """Captured once, replayed with new lengths (padding <-> live requests), new cache contents and
    a reshuffled block table: the grid depends on shapes only, so replay equals eager. 16 heads
    run the keys-major form; 128 on Hopper the Gluon form (its tensor descriptors are made at
    capture and name the static cache)."""
    capacity, s_q = [1500, 1500, 1500, 1500], 1
    num_pages = 4 * (1500 // DS_PAGE + 1) + 3
    states = []
    for seed, lens in [(0, [1500, 0, 33, 900]), (1, [0, 1200, 1500, 1])]:
        t = make_block_table(capacity, DS_PAGE, num_pages, seed=seed)
        cache, _, _ = make_cache("bf16", lens, DS_PAGE, latent=DS_L, rope=DS_R, seed=seed, table=t,
                                 num_pages=num_pages)
        q_nope, q_pe = make_q(4, s_q, heads, latent=DS_L, rope=DS_R, dtype=torch.bfloat16, seed=seed + 5)
        states.append([q_nope, q_pe, cache, t, torch.tensor(lens, dtype=torch.int32)])
    static = [x.to(device) for x in states[0]]
    assert states[0][3].shape == states[1][3].shape

    def step():
        return triton_decode(*static, None, "bf16", SM_SCALE)

    graph, (out, lse) = capture_cuda_graph(step)
    for state in states:
        for dst, src in zip(static, state):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        eager_out, eager_lse = step()
        assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)
        want_out, want_lse = ref_decode(*state, None, "bf16", SM_SCALE)
        torch.testing.assert_close(out.cpu().float(), want_out.float(), **BF16_TOL)
        torch.testing.assert_close(lse.cpu(), want_lse, atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------------------------------------
# configuration, errors, opcheck


def test_default_config_heuristic():
    cfg = kernels().default_config
    big = cfg(128, 128, 4096, 512, "bf16", torch.bfloat16)  # compute-bound: 2 row blocks of 64
    assert (big["BLOCK_H"], big["num_warps"], big["MAX_SPLITS"]) == (64, 8, 1)
    small = cfg(128, 16, 4096, 512, "bf16", torch.bfloat16)  # memory-bound: one 16-row block
    assert (small["BLOCK_H"], small["BLOCK_N"]) == (16, 32) and small["MAX_SPLITS"] >= 2
    lone = cfg(1, 16, 4096, 512, "fp8_ds", torch.bfloat16)  # one request: split its keys wide
    assert lone["MAX_SPLITS"] >= 16
    assert cfg(4, 16, 48, 512, "bf16", torch.bfloat16)["MAX_SPLITS"] == 1  # too short to split
    verify = cfg(8, 3 * 128, 4096, 512, "bf16", torch.bfloat16)  # s_q rows join the heads
    assert verify["BLOCK_H"] == 64


def test_default_config_keys_major_where_tma_reads_the_cache():
    """With keys_tma (the caller found the cache's 64-key blocks copyable whole) a bf16 cache at 32
    rows or fewer takes the keys-major TMA form, its splits filling the SMs once; anything else
    keeps the rows form."""
    cfg = kernels().default_config
    keys = {"FORM": "keys", "TMA": True, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
    for rows, block_h in ((16, 16), (32, 32), (8, 16)):
        got = cfg(128, rows, 4096, 512, "bf16", torch.bfloat16, 132, keys_tma=True)
        assert {k: got[k] for k in keys} == keys and got["BLOCK_H"] == block_h
    assert cfg(128, 16, 4096, 512, "bf16", torch.bfloat16, 132, keys_tma=True)["MAX_SPLITS"] == 1
    assert cfg(64, 16, 16384, 512, "bf16", torch.bfloat16, 132, keys_tma=True)["MAX_SPLITS"] == 2
    lone = cfg(1, 16, 1024, 512, "bf16", torch.bfloat16, 132, keys_tma=True)
    assert lone["MAX_SPLITS"] == 16  # one request: one 64-key block a split
    for args in [(128, 48, 4096, 512, "bf16", torch.bfloat16), (128, 16, 4096, 512, "fp8_ds", torch.bfloat16),
                 (128, 16, 4096, 512, "bf16", torch.float32)]:
        assert cfg(*args, 132, keys_tma=True)["FORM"] == "rows"
    assert cfg(128, 16, 4096, 512, "bf16", torch.bfloat16, 132)["FORM"] == "rows"


def test_bad_config():
    args = decode_args("bf16-f32", [3, 0], 1, 4)
    with pytest.raises(ValueError, match="BLOCK_N must be a power of two"):
        kernels().mla_decode_with_config(*args, config={"BLOCK_N": 24})
    with pytest.raises(ValueError, match="MAX_SPLITS must be >= 1"):
        kernels().mla_decode_with_config(*args, config={"MAX_SPLITS": 0})
    with pytest.raises(ValueError, match="unknown keys"):
        kernels().mla_decode_with_config(*args, config={"BLOCK_M": 32})


@pytest.mark.parametrize("kind", ["bf16-f32", "fp8"])
def test_dims_that_are_not_powers_of_two(device, kind):
    """Tiny models (kv_lora 96, rope 8) run through masked columns of the next power of two."""
    check(decode_args(kind, [3, 0, 11], 2, 4, latent=96, rope=8), device)


def test_bad_input():
    args = decode_args("fp8", [3, 0, 9], 2, 4)
    args[3] = args[3].long()
    assert_value_error(triton_decode, args, arg_error("block_table"))


@pytest.mark.parametrize("kind,s_q", [("bf16", 1), ("fp8_ds", 3)])
def test_opcheck(kind, s_q):
    helpers.opcheck(triton_decode, decode_args(kind, [3, 0, 9], s_q, 4))


# ---------------------------------------------------------------------------------------------
# the Gluon form (decode_wgmma): Hopper, bf16, more than 32 rows

WGMMA = {"FORM": "wgmma"}


SEESAW = {**WGMMA, "SEESAW": True}


@cuda_only
@pytest.mark.parametrize("config", [WGMMA, {**WGMMA, "MAX_SPLITS": 1}, {**WGMMA, "MAX_SPLITS": 3},
                                    {**WGMMA, "num_stages": 1}, {**WGMMA, "OVERLAP": True},
                                    {**WGMMA, "OVERLAP": True, "MAX_SPLITS": 3},
                                    SEESAW, {**SEESAW, "MAX_SPLITS": 1}, {**SEESAW, "MAX_SPLITS": 3}],
                         ids=["default", "direct", "splits3", "one_stage", "overlap", "overlap_splits3",
                              "seesaw", "seesaw_direct", "seesaw_splits3"])
@pytest.mark.parametrize("s_q", [1, 2])
@pytest.mark.parametrize("heads", [40, 64, 128])
def test_deepseek_shapes_wgmma(device, heads, s_q, config):
    """Partial last blocks (2900, 700, 3001, 129 keys), a block of exactly 64, a padding and a
    one-token request, a -1 page among request 0's whole blocks (its keys read as zeros and
    masked), a row block with padding rows (40 heads), split boundaries (3 splits)."""
    args = decode_args("bf16", DS_LENS, s_q, DS_PAGE, heads=heads, latent=DS_L, rope=DS_R, q_dtype=torch.bfloat16)
    args[3][0, 3] = -1
    out, lse = check(args, device, config=config, **BF16_TOL)
    assert_padding(out, lse, DS_LENS, s_q)


@pytest.mark.gpu
def test_wgmma_runs_on_hopper_for_deepseek_caches():
    """On an sm_90 card the launcher finds nothing against the Gluon form for DeepSeek's bf16
    cache, and the heuristic, told it can run, picks it for 64 and 128 rows (not for 32)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon form is sm_90 only")
    args = on("cuda", decode_args("bf16", [70, 5], 1, DS_PAGE, heads=128, latent=DS_L, rope=DS_R,
                                  q_dtype=torch.bfloat16))
    assert kernels().wgmma_blocks(args[0], args[2], "bf16", DS_L, DS_R) is None
    cfg = kernels().default_config
    assert cfg(128, 128, 4096, 512, "bf16", torch.bfloat16, 132, wgmma=True)["FORM"] == "wgmma"
    assert cfg(128, 64, 4096, 512, "bf16", torch.bfloat16, 132, wgmma=True)["FORM"] == "wgmma"
    assert cfg(128, 16, 4096, 512, "bf16", torch.bfloat16, 132, wgmma=True)["FORM"] != "wgmma"


def test_wgmma_config_is_checked():
    """The Gluon form's fixed tile is refused with other sizes, and asked for where it cannot run
    (here: on CPU) it says why instead of falling back silently."""
    args = decode_args("bf16-f32", [3, 0], 1, 4)
    with pytest.raises(ValueError, match="FORM 'wgmma' takes BLOCK_H 64, got 32"):
        kernels()._check_config({**kernels().default_config(2, 64, 8, L, "bf16", torch.bfloat16, wgmma=True),
                                 "BLOCK_H": 32}, {"BLOCK_H": 32})
    with pytest.raises(ValueError, match="FORM 'wgmma' asked for, but"):
        kernels().mla_decode_with_config(*args, config={"FORM": "wgmma"})
    wgmma = kernels().default_config(2, 64, 8, L, "bf16", torch.bfloat16, wgmma=True)
    with pytest.raises(ValueError, match="OVERLAP needs num_stages >= 2, got 1"):
        kernels()._check_config({**wgmma, "num_stages": 1, "OVERLAP": True}, {"num_stages": 1, "OVERLAP": True})
    with pytest.raises(ValueError, match="OVERLAP needs FORM 'wgmma'"):
        kernels().mla_decode_with_config(*args, config={"OVERLAP": True})
    with pytest.raises(ValueError, match="SEESAW takes num_stages 2 and no OVERLAP, got num_stages 1, OVERLAP False"):
        kernels()._check_config({**wgmma, "num_stages": 1, "SEESAW": True}, {"num_stages": 1, "SEESAW": True})
    with pytest.raises(ValueError, match="SEESAW takes num_stages 2 and no OVERLAP, got num_stages 2, OVERLAP True"):
        kernels()._check_config({**wgmma, "OVERLAP": True, "SEESAW": True}, {"OVERLAP": True, "SEESAW": True})
    with pytest.raises(ValueError, match="SEESAW needs FORM 'wgmma'"):
        kernels().mla_decode_with_config(*args, config={"SEESAW": True})
    keys = kernels().default_config(2, 16, 4096, 512, "bf16", torch.bfloat16, 132, keys_tma=True)
    assert keys["FORM"] == "keys" and keys["TMA"]
    kernels()._check_config({**keys, "WS": True}, {"WS": True})  # the keys form's config takes WS
    with pytest.raises(ValueError, match="WS takes FORM keys, got rows"):
        kernels()._check_config({**keys, "WS": True, "FORM": "rows", "TMA": False}, {"WS": True, "FORM": "rows"})
    with pytest.raises(ValueError, match="WS asked for, but it needs a Hopper GPU"):
        kernels().mla_decode_with_config(*args, config={"FORM": "keys", "TMA": True, "WS": True})
    with pytest.raises(ValueError, match="WS takes BLOCK_H <= 32, got 64"):
        kernels()._check_config({**keys, "WS": True, "BLOCK_H": 64}, {"WS": True, "BLOCK_H": 64})
    wg = kernels().default_config(128, 128, 4096, 512, "bf16", torch.bfloat16, 132, wgmma=True)
    assert (wg["BLOCK_H"], wg["BLOCK_N"], wg["num_warps"], wg["num_stages"], wg["TMA"]) == (64, 64, 8, 2, True)
    assert wg["MAX_SPLITS"] == 1  # 256 programs on 132 SMs: two nearly full waves
    few = kernels().default_config(128, 32, 4096, 512, "bf16", torch.bfloat16, 132, wgmma=True)
    assert few["FORM"] == "wgmma" and few["MAX_SPLITS"] == 1  # 128 programs: one wave


@pytest.mark.parametrize("op", ["mla_decode", "sparse_mla"])
@pytest.mark.parametrize("stages", [0, 3])
def test_wgmma_stages_checked(op, stages):
    """The Gluon kernels' stage count, shared by the dense and sparse launchers: none, or more
    key blocks than an SM's shared memory holds beside q and P, is refused naming the op."""
    decode_wgmma = importlib.import_module("mlagraph.ops.triton.decode_wgmma")
    decode_wgmma.check_stages(op, 2, 512, 64)  # the default fits
    with pytest.raises(ValueError, match=rf"{op} config: FORM 'wgmma' needs num_stages >= 1 .*got {stages}"):
        decode_wgmma.check_stages(op, stages, 512, 64)


def test_wgmma_kernel_builds_for_sm90():
    """Compiled for sm_90 offline with this machine's Triton (no GPU needed): Gluon's API moves
    between Triton releases, so CI builds the kernel it cannot run. Warp-group MMAs only, and
    the shared memory the launcher budgets (decode_wgmma.shared_bytes) covers what it takes.
    In a child process: this one runs Triton's interpreter, whose functions Gluon cannot compile."""
    decode_wgmma = importlib.import_module("mlagraph.ops.triton.decode_wgmma")
    if not decode_wgmma.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    code = ("import json; from mlagraph.ops.triton import decode_wgmma as d\n"
            "builds = [d.compile_for_sm90(s_q=s_q, splits=splits, overlap=overlap)"
            " for s_q, splits, overlap in ((1, 2, False), (2, 1, False), (1, 2, True))]\n"
            "print(json.dumps([[k.asm['ptx'].count('wgmma.mma_async'), k.asm['ptx'].count('mma.sync'),"
            " k.metadata.shared] for k in builds]))")
    for wgmma, mma_sync, shared in helpers.sm90_build_report(code):
        assert wgmma > 0 and mma_sync == 0
        assert 0 < shared <= decode_wgmma.shared_bytes(512, 64, 2) <= decode_wgmma.SHARED_LIMIT


def test_stream_kernel_builds_for_sm90():
    """The Gluon keys form (decode_stream) built for sm_90 offline at 16 and 32 rows, direct and
    split, for each cache layout at the slots its launcher picks: warp-group MMAs only, its
    shared memory within the launcher's bound."""
    decode_stream = importlib.import_module("mlagraph.ops.triton.decode_stream")
    if not decode_stream.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    code = ("import json; from mlagraph.ops.triton import decode_stream as d\n"
            "cases = [(s_q, splits, layout, d.pick_stages(16 * s_q, 512, 64, layout))"
            " for s_q, splits in ((1, 1), (2, 2)) for layout in ('bf16', 'fp8', 'fp8_ds')]\n"
            "builds = [(d.compile_for_sm90(s_q=s_q, heads=16, splits=sp, layout=lay, stages=st),"
            " d.shared_bytes(16 * s_q, 512, 64, lay, st)) for s_q, sp, lay, st in cases]\n"
            "print(json.dumps([[k.asm['ptx'].count('wgmma.mma_async'), k.asm['ptx'].count('mma.sync'),"
            " k.metadata.shared, bound] for k, bound in builds]))")
    limit = importlib.import_module("mlagraph.ops.triton.decode_wgmma").SHARED_LIMIT
    for wgmma, mma_sync, shared, bound in helpers.sm90_build_report(code):
        assert wgmma > 0 and mma_sync == 0
        assert 0 < shared <= bound <= limit


def test_seesaw_kernel_builds_for_sm90():
    """The seesaw form (seesaw) built for sm_90 offline, direct and split: warp-group MMAs
    only, the three partitions' register budgets set (setmaxnreg), and its shared memory within
    what its launcher budgets and an SM holds."""
    seesaw = importlib.import_module("mlagraph.ops.triton.seesaw")
    if not seesaw.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    code = ("import json; from mlagraph.ops.triton import seesaw as d\n"
            "builds = [d.compile_for_sm90(s_q=s_q, splits=splits) for s_q, splits in ((1, 1), (2, 3))]\n"
            "print(json.dumps([[k.asm['ptx'].count('wgmma.mma_async'), k.asm['ptx'].count('mma.sync'),"
            " k.asm['ptx'].count('setmaxnreg'), k.metadata.shared] for k in builds]))")
    limit = importlib.import_module("mlagraph.ops.triton.decode_wgmma").SHARED_LIMIT
    for wgmma, mma_sync, setmaxnreg, shared in helpers.sm90_build_report(code):
        assert wgmma > 0 and mma_sync == 0 and setmaxnreg > 0
        assert 0 < shared <= seesaw.shared_bytes(512, 64) <= limit
