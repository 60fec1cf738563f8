"""Triton rope / latent cache kernels against the reference ops (run on CPU copies of the inputs).

Rotated values and dequantized rows are compared with dtype tolerances (reads exactly: a read is
one multiply); cache bytes must be bit-identical to what the reference writer produces from the
same starting cache. CPU runs use tiny shapes through Triton's interpreter (H=3 and L=384 also
exercise the head and group masks); CUDA runs use DeepSeek's L=512, R=64, H=128, page 64.
"""

import pytest
import torch

from mlagraph.ops import layouts  # (imports mlagraph, which registers the ops)
from mlagraph.ops.rope import rope_cos_sin_cache
from tests import helpers
from tests.helpers import NoHostSync, arg_error, assert_value_error, capture_cuda_graph, make_block_table, slots_for

ref = torch.ops.mlagraph
tri = torch.ops.mlagraph_triton

F32, BF16, FP8, U8 = torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.uint8
# (layout, model dtype, cache dtype)
VARIANTS = [
    ("bf16", F32, F32),
    ("bf16", BF16, BF16),
    ("bf16", F32, BF16),
    ("fp8", BF16, FP8),
    ("fp8", F32, FP8),
    ("fp8_ds", F32, U8),
    ("fp8_ds", BF16, U8),
]
IDS = [f"{v[0]}-{str(v[1])[6:]}-{str(v[2])[6:]}" for v in VARIANTS]
FP8_SCALE = 0.02


def _dims(device):
    if device.type == "cpu":
        return dict(T=5, H=3, DN=24, L=384, R=16, PAGES=8, PAGE=4, POS=64, LENS=[5, 0, 9, 1])
    return dict(T=37, H=128, DN=512, L=512, R=64, PAGES=64, PAGE=64, POS=4096, LENS=[300, 0, 1000, 1, 64, 77])


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _table(rope_dim, max_pos, device):
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 1.2}
    return rope_cos_sin_cache(rope_dim, max_pos, 10000.0, scaling).to(device)


def _cache(layout, cache_dtype, latent, rope_dim, pages, page, device):
    """Random non-zero rows (raw bytes for fp8_ds), so any row written by mistake shows."""
    width = layouts.latent_row_width(layout, latent, rope_dim)
    if cache_dtype == U8:
        return torch.randint(1, 256, (pages, page, width), dtype=U8, device=device)
    return (torch.randn(pages, page, width, device=device) + 3).to(cache_dtype)


def _scale(layout, device):
    return torch.tensor([FP8_SCALE], device=device) if layout == "fp8" else None


def _cpu(args):
    return [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]


def _bytes(t):
    return t.cpu().view(torch.uint8)


def _slots(t, pages, page, device, dtype=torch.int64):
    """Distinct random slots, with -1 first and in the middle (skipped tokens)."""
    slots = torch.randperm(pages * page)[:t]
    slots[0] = -1
    slots[t // 2] = -1
    return slots.to(dtype).to(device)


def _close(got, want):
    tol = dict(rtol=1e-4, atol=1e-5) if want.dtype == F32 else dict(rtol=2e-2, atol=2e-2)
    assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got.cpu(), want, **tol)


# ---------------------------------------------------------------------------------------------
# rope


@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("interleaved", [True, False])
def test_rope(device, interleaved, dtype, pos_dtype):
    d = _dims(device)
    t, h, r = d["T"], d["H"], d["R"]
    # q_pe as the tail of a wider q (strided heads), k_pe as the tail of kv_a's output.
    q_pe = torch.randn(t, h, d["DN"] + r, dtype=dtype, device=device)[..., d["DN"]:]
    k_pe = torch.randn(t, d["L"] + r, dtype=dtype, device=device)[:, None, d["L"]:]
    positions = torch.randint(0, d["POS"], (t,), dtype=pos_dtype, device=device)
    args = (q_pe, k_pe, positions, _table(r, d["POS"], device), interleaved)
    q_rot, k_rot = tri.rope(*args)
    want_q, want_k = ref.rope(*_cpu(args))
    _close(q_rot, want_q)
    _close(k_rot, want_k)


def test_rope_keys_only(device):
    """No query heads (the V3.2 indexer rotates its keys alone): K is still rotated."""
    d = _dims(device)
    t, r = d["T"], d["R"]
    args = (torch.randn(t, 0, r, device=device), torch.randn(t, 1, r, device=device),
            torch.randint(0, d["POS"], (t,), device=device), _table(r, d["POS"], device), False)
    q_rot, k_rot = tri.rope(*args)
    want_q, want_k = ref.rope(*_cpu(args))
    assert q_rot.shape == (t, 0, r)
    _close(k_rot, want_k)


# ---------------------------------------------------------------------------------------------
# latent_cache_write


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "page1"])
@pytest.mark.parametrize("layout, dtype, cache_dtype", VARIANTS, ids=IDS)
def test_latent_cache_write(device, layout, dtype, cache_dtype, paged):
    d = _dims(device)
    t, latent, r = d["T"], d["L"], d["R"]
    page = d["PAGE"] if paged else 1
    pages = d["PAGES"] * d["PAGE"] // page
    # The cache is one half of a wider buffer (as a per-layer view would be): pages dense, rows
    # strided. The other half must come out untouched.
    base = _cache(layout, cache_dtype, latent, r, pages, page * 2, device).view(pages, page, 2, -1)
    kv_cache = base[:, :, 1]
    kv = torch.randn(t, latent + r, dtype=dtype, device=device)
    slots = _slots(t, pages, page, device, torch.int32 if paged else torch.int64)
    args = (kv[:, :latent], kv[:, latent:], kv_cache, slots, _scale(layout, device), layout)
    want = base.cpu().clone()
    ref.latent_cache_write(*_cpu(args[:2]), want[:, :, 1], *_cpu(args[3:]))
    assert tri.latent_cache_write(*args) is None
    assert torch.equal(_bytes(base), want.view(torch.uint8))


@pytest.mark.parametrize("layout", ["bf16", "fp8_ds"])
def test_latent_cache_write_zero_tokens_and_all_skipped(device, layout):
    d = _dims(device)
    dtype = layouts.latent_storage_dtype(layout, F32)
    kv_cache = _cache(layout, dtype, d["L"], d["R"], d["PAGES"], d["PAGE"], device)
    before = kv_cache.clone()
    for t, slot in ((0, 0), (3, -1)):
        kv_c = torch.randn(t, d["L"], device=device)
        k_pe = torch.randn(t, d["R"], device=device)
        tri.latent_cache_write(kv_c, k_pe, kv_cache, torch.full((t,), slot, device=device), None, layout)
        assert torch.equal(_bytes(kv_cache), _bytes(before))


# ---------------------------------------------------------------------------------------------
# latent_cache_read


def _written_cache(layout, cache_dtype, latent, r, pages, page, device):
    """A cache fully written by the reference writer: every row holds valid bytes (random fp8_ds
    bytes can decode to NaN, which a reader need not reproduce bit for bit)."""
    model_dtype = cache_dtype if layout == "bf16" else F32
    cache = torch.zeros(pages, page, layouts.latent_row_width(layout, latent, r), dtype=cache_dtype)
    n = pages * page
    ref.latent_cache_write(torch.randn(n, latent, dtype=model_dtype), torch.randn(n, r, dtype=model_dtype), cache,
                           torch.randperm(n), _scale(layout, "cpu"), layout)
    return cache.to(device)


@pytest.mark.parametrize("out_dtype", [F32, BF16])
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "page1"])
@pytest.mark.parametrize("layout, cache_dtype", [("bf16", F32), ("bf16", BF16), ("fp8", FP8), ("fp8_ds", U8)])
def test_latent_cache_read(device, layout, cache_dtype, paged, out_dtype):
    d = _dims(device)
    lens, latent, r = d["LENS"], d["L"], d["R"]
    page = d["PAGE"] if paged else 1
    pages = max(d["PAGES"] * d["PAGE"] // page, sum(lens))
    kv_cache = _written_cache(layout, cache_dtype, latent, r, pages, page, device)
    block_table = make_block_table(lens, page, pages, seed=1)
    block_table[-1, 0] = -1  # a -1 page inside a request reads row 0, as the reference does
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    args = (kv_cache, block_table.to(device), cu.to(device), _scale(layout, device), layout, r, out_dtype, sum(lens))
    got = tri.latent_cache_read(*args)
    want = ref.latent_cache_read(*_cpu(args))
    for g, w in zip(got, want):
        assert g.dtype == out_dtype and g.shape == w.shape and g.is_contiguous()
        assert torch.equal(g.cpu(), w)


def test_latent_cache_read_no_tokens(device):
    d = _dims(device)
    kv_cache = _written_cache("bf16", F32, d["L"], d["R"], 2, d["PAGE"], device)
    block_table = torch.tensor([[0, -1], [1, -1]], dtype=torch.int32, device=device)
    cu = torch.zeros(3, dtype=torch.int32, device=device)
    kv_c, k_pe = tri.latent_cache_read(kv_cache, block_table, cu, None, "bf16", d["R"], BF16, 0)
    assert kv_c.shape == (0, d["L"]) and k_pe.shape == (0, d["R"]) and kv_c.dtype == BF16


def test_latent_cache_read_has_no_host_sync(device):
    d = _dims(device)
    from mlagraph.ops.triton import rope_cache

    kv_cache = _written_cache("fp8_ds", U8, d["L"], d["R"], d["PAGES"], d["PAGE"], device)
    block_table = make_block_table(d["LENS"], d["PAGE"], d["PAGES"]).to(device)
    cu = torch.tensor([0] + torch.tensor(d["LENS"]).cumsum(0).tolist(), dtype=torch.int32, device=device)
    with NoHostSync():
        rope_cache.latent_cache_read(kv_cache, block_table, cu, None, "fp8_ds", d["R"], BF16, sum(d["LENS"]))


# ---------------------------------------------------------------------------------------------
# fused_rope_concat_cache_write


def _fused_args(device, layout, dtype, cache_dtype, interleaved, t, h, dn, pos_dtype=torch.int64):
    d = _dims(device)
    latent, r = d["L"], d["R"]
    # q_nope / q_pe split from one q and kv_c / k_pe from one kv_a output, as the model makes them.
    q = torch.randn(t, h, dn + r, dtype=dtype, device=device)
    kv = torch.randn(t, latent + r, dtype=dtype, device=device)
    positions = torch.randint(0, d["POS"], (t,), dtype=pos_dtype, device=device)
    kv_cache = _cache(layout, cache_dtype, latent, r, d["PAGES"], d["PAGE"], device)
    slots = _slots(t, d["PAGES"], d["PAGE"], device) if t else torch.zeros(0, dtype=torch.int64, device=device)
    return (q[..., :dn], q[..., dn:], kv[:, :latent], kv[:, None, latent:], positions, _table(r, d["POS"], device),
            kv_cache, slots, _scale(layout, device), layout, interleaved)


def _check_fused(args):
    want_cache = args[6].cpu().clone()
    want_q, want_k = ref.fused_rope_concat_cache_write(*_cpu(args[:6]), want_cache, *_cpu(args[7:]))
    q, k = tri.fused_rope_concat_cache_write(*args)
    dn = args[0].shape[2]
    _close(q, want_q)
    assert torch.equal(q[..., :dn].cpu(), want_q[..., :dn])  # the concat is a copy
    _close(k, want_k)
    assert torch.equal(_bytes(args[6]), want_cache.view(torch.uint8))


@pytest.mark.parametrize("nope", [True, False], ids=["dn", "dn0"])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("layout, dtype, cache_dtype", VARIANTS, ids=IDS)
def test_fused(device, layout, dtype, cache_dtype, interleaved, nope):
    d = _dims(device)
    pos_dtype = torch.int32 if interleaved else torch.int64
    dn = d["DN"] if nope else 0  # Dn = 0: decode reads q_nope separately, q is just rope(q_pe)
    _check_fused(_fused_args(device, layout, dtype, cache_dtype, interleaved, d["T"], d["H"], dn, pos_dtype))


def test_fused_zero_tokens(device):
    d = _dims(device)
    args = _fused_args(device, "fp8_ds", BF16, U8, True, 0, d["H"], d["DN"])
    before = args[6].clone()
    q, k = tri.fused_rope_concat_cache_write(*args)
    assert q.shape == (0, d["H"], d["DN"] + d["R"]) and k.shape == (0, 1, d["R"])
    assert torch.equal(args[6], before)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 128])
@pytest.mark.parametrize("h", [16, 128])
@pytest.mark.parametrize("layout, dtype, cache_dtype", [("bf16", BF16, BF16), ("fp8_ds", BF16, U8)])
def test_fused_decode_shapes_cuda(layout, dtype, cache_dtype, h, t):
    """DeepSeek decode: Dn = L = 512, R = 64, B = T = 1 and 128 (both block-size regimes)."""
    if not torch.cuda.is_available():
        pytest.fail("gpu tests need a CUDA device")
    _check_fused(_fused_args(torch.device("cuda"), layout, dtype, cache_dtype, True, t, h, 512))


@pytest.mark.gpu
def test_fused_cuda_graph_replay():
    """Captured once, replayed on new inputs (positions, slots, values): matches the reference."""
    if not torch.cuda.is_available():
        pytest.fail("gpu tests need a CUDA device")
    dev = torch.device("cuda")
    args = list(_fused_args(dev, "fp8_ds", BF16, U8, True, 128, 128, 512))
    graph, (q, k) = capture_cuda_graph(lambda: tri.fused_rope_concat_cache_write(*args))
    fresh = _fused_args(dev, "fp8_ds", BF16, U8, True, 128, 128, 512)
    for i in (0, 1, 2, 3, 4, 7):  # q_nope, q_pe, kv_c, k_pe, positions, slots
        args[i].copy_(fresh[i])
    want_cache = args[6].cpu().clone()
    want_q, want_k = ref.fused_rope_concat_cache_write(*_cpu(args[:6]), want_cache, *_cpu(args[7:]))
    graph.replay()
    torch.cuda.synchronize()
    _close(q, want_q)
    _close(k, want_k)
    assert torch.equal(_bytes(args[6]), want_cache.view(torch.uint8))


def test_block_config_override(device):
    """A benchmark may sweep configs; every variant computes the same result."""
    from mlagraph.ops.triton import rope_cache

    d = _dims(device)
    args = _fused_args(device, "fp8", BF16, FP8, False, d["T"], d["H"], d["DN"])
    base = rope_cache.rope_cache_config(d["T"], d["H"], d["DN"], d["R"], 2)
    assert base["block_h"] in (1, 2, 4, 8, 16) and base["num_stages"] == 1
    results = []
    for cfg in ({}, {"block_h": 2, "block_dn": 16, "num_warps": 2}, {"block_h": 4, "num_warps": 1}):
        cache = args[6].clone()
        q, k = rope_cache.fused_rope_concat_cache_write(*args[:6], cache, *args[7:], config=cfg)
        results.append((q, k, _bytes(cache)))
    for q, k, c in results[1:]:
        assert torch.equal(q, results[0][0]) and torch.equal(k, results[0][1]) and torch.equal(c, results[0][2])


# ---------------------------------------------------------------------------------------------
# bad inputs and opcheck (tiny CPU inputs through the mlagraph_triton ops)

L, R = 256, 16


def _tiny():
    q_nope, q_pe = torch.randn(3, 2, 8), torch.randn(3, 2, R)
    kv_c, k_pe = torch.randn(3, L), torch.randn(3, 1, R)
    positions, table = torch.tensor([0, 5, 2]), _table(R, 8, "cpu")
    cache = _written_cache("fp8_ds", U8, L, R, 3, 2, "cpu")
    slots = torch.tensor([4, -1, 1])
    return q_nope, q_pe, kv_c, k_pe, positions, table, cache, slots


def test_bad_inputs():
    q_nope, q_pe, kv_c, k_pe, positions, table, cache, slots = _tiny()
    assert_value_error(tri.rope, (q_pe[..., :-1], k_pe[..., :-1], positions, table[:, :-1], True), arg_error("q_pe"))
    assert_value_error(tri.latent_cache_write, (kv_c, k_pe[:, 0], cache, slots, None, "fp8"), arg_error("kv_cache"))
    block_table, cu = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32)
    assert_value_error(tri.latent_cache_read, (cache, block_table, cu.long(), None, "fp8_ds", R, F32, 3),
                       arg_error("cu_seq_lens"))
    assert_value_error(tri.fused_rope_concat_cache_write,
                       (q_nope, q_pe, kv_c.bfloat16(), k_pe, positions, table, cache, slots, None, "fp8_ds", True),
                       arg_error("kv_c"))


def test_opcheck():
    q_nope, q_pe, kv_c, k_pe, positions, table, cache, slots = _tiny()
    helpers.opcheck(tri.rope, (q_pe, k_pe, positions.int(), table, False))
    helpers.opcheck(tri.latent_cache_write, (kv_c, k_pe[:, 0], cache, slots, None, "fp8_ds"))
    fp8 = _written_cache("fp8", FP8, L, R, 3, 2, "cpu")
    block_table = make_block_table([3, 2], 2, 3)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    helpers.opcheck(tri.latent_cache_read, (fp8, block_table, cu, torch.tensor([FP8_SCALE]), "fp8", R, BF16, 5))
    helpers.opcheck(tri.fused_rope_concat_cache_write,
                    (q_nope, q_pe, kv_c, k_pe, positions, table, cache, slots, None, "fp8_ds", True))


def test_slots_for_matches_kernel_addressing():
    """Written through slots_for, read back through the block table: the same rows."""
    lens, page = [3, 5], 2
    block_table = make_block_table(lens, page, 6, seed=2)
    kv_c, k_pe = torch.randn(8, L), torch.randn(8, R)
    slots = torch.tensor(slots_for(block_table, page, 0, range(3)) + slots_for(block_table, page, 1, range(5)))
    cache = torch.zeros(6, page, L + R)
    tri.latent_cache_write(kv_c, k_pe, cache, slots, None, "bf16")
    got_kv, got_pe = tri.latent_cache_read(cache, block_table, torch.tensor([0, 3, 8], dtype=torch.int32), None,
                                           "bf16", R, F32, 8)
    assert torch.equal(got_kv, kv_c) and torch.equal(got_pe, k_pe)
