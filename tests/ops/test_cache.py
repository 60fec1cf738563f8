"""Latent cache ops: write / read / fused RoPE+concat+write against float64 loops and raw bytes."""

import pytest
import torch

import mlagraph  # noqa: F401  (registers the ops)
from mlagraph.ops import layouts
from mlagraph.ops._define import op_body
from mlagraph.ops.rope import rope_cos_sin_cache
from tests import helpers
from tests.helpers import arg_error, assert_value_error, make_block_table, slots_for
from tests.ops.test_rope import NoHostSync

write = torch.ops.mlagraph.latent_cache_write
read = torch.ops.mlagraph.latent_cache_read
fused = torch.ops.mlagraph.fused_rope_concat_cache_write
rope = torch.ops.mlagraph.rope

L, R = 256, 16  # two fp8_ds groups; DeepSeek's 512 / 64 is tested separately
PAGES, PAGE = 8, 4
FP8_SCALE = 0.02  # randn / 0.02 stays well inside e4m3's +-448
# (layout, model dtype, cache dtype): the "bf16" layout holds whatever float dtype the model uses.
VARIANTS = [
    ("bf16", torch.float32, torch.float32),
    ("bf16", torch.bfloat16, torch.bfloat16),
    ("bf16", torch.float32, torch.bfloat16),
    ("fp8", torch.bfloat16, torch.float8_e4m3fn),
    ("fp8_ds", torch.float32, torch.uint8),
]
IDS = [f"{v[0]}-{str(v[1])[6:]}-{str(v[2])[6:]}" for v in VARIANTS]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _cache(layout, cache_dtype, latent=L, rope_dim=R, pages=PAGES, page=PAGE):
    """A cache full of random non-zero values, so an untouched row is recognisable."""
    width = layouts.latent_row_width(layout, latent, rope_dim)
    if cache_dtype == torch.uint8:
        return torch.randint(1, 256, (pages, page, width), dtype=torch.uint8)
    return (torch.randn(pages, page, width) + 3).to(cache_dtype)


def _scale(layout):
    return torch.tensor([FP8_SCALE]) if layout == "fp8" else None


def _bytes(t):
    return t.view(torch.uint8).clone()


def _check_fp8(got, want, scale):
    """got within e4m3 rounding (3 mantissa bits; subnormal spacing 2^-9) of want, both float64."""
    err = (got - want).abs()
    bound = 2**-4 * want.abs() + 2**-10 * scale + 1e-12
    assert bool((err <= bound).all()), f"max excess {(err - bound).max()}"


def _check_row(layout, row, kv_c, k_pe, cache_dtype):
    """One written cache row against kv_c [L], k_pe [R] (float64), from the layout's definition."""
    latent = kv_c.shape[0]
    if layout == "bf16":
        assert torch.equal(row, torch.cat([kv_c, k_pe]).to(cache_dtype))
    elif layout == "fp8":
        _check_fp8(row.double() * FP8_SCALE, torch.cat([kv_c, k_pe]), FP8_SCALE)
    else:
        groups = latent // 128
        scales = row[latent : latent + 4 * groups].view(torch.float32).double()
        want_scales = kv_c.reshape(groups, 128).abs().amax(-1) / 448
        torch.testing.assert_close(scales, want_scales, rtol=1e-6, atol=0)
        values = row[:latent].view(torch.float8_e4m3fn).double().reshape(groups, 128)
        for g in range(groups):
            _check_fp8(values[g] * scales[g], kv_c[g * 128 : (g + 1) * 128], float(scales[g]))
        assert torch.equal(row[latent + 4 * groups :].view(torch.bfloat16), k_pe.to(torch.bfloat16))


def _check_written(layout, before, after, kv_c, k_pe, slots, cache_dtype):
    """Every slot >= 0 holds its token; every other row of the cache is bit-identical."""
    width = after.shape[-1]
    before, after = before.view(-1, width), after.view(-1, width)
    written = {}
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            written[s] = t  # the last writer wins (not exercised: slots are distinct)
    for s in range(after.shape[0]):
        if s in written:
            t = written[s]
            _check_row(layout, after[s], kv_c[t].double(), k_pe[t].double(), cache_dtype)
        else:
            assert torch.equal(_bytes(after[s]), _bytes(before[s])), f"row {s} changed"


# ---------------------------------------------------------------------------------------------
# write


@pytest.mark.parametrize("layout, dtype, cache_dtype", VARIANTS, ids=IDS)
def test_write_numerics_and_skip(layout, dtype, cache_dtype):
    # -1 first (the reference redirects skipped rows to the first valid one) and in the middle;
    # the cache's last row is never a target, so a -1 that wraps around would show.
    slots = torch.tensor([-1, 5, 17, -1, 0, 30], dtype=torch.int32)
    kv_c, k_pe = torch.randn(6, L, dtype=dtype), torch.randn(6, R, dtype=dtype)
    cache = _cache(layout, cache_dtype)
    before = cache.clone()
    write(kv_c, k_pe, cache, slots, _scale(layout), layout)
    _check_written(layout, before, cache, kv_c, k_pe, slots, cache_dtype)


@pytest.mark.parametrize("layout, dtype, cache_dtype", VARIANTS, ids=IDS)
def test_write_all_skipped_leaves_cache_bit_identical(layout, dtype, cache_dtype):
    cache = _cache(layout, cache_dtype)
    before = _bytes(cache)
    write(torch.randn(3, L, dtype=dtype), torch.randn(3, R, dtype=dtype), cache, torch.full((3,), -1), _scale(layout), layout)
    assert torch.equal(_bytes(cache), before)


def test_write_zero_tokens():
    cache = _cache("fp8_ds", torch.uint8)
    before = _bytes(cache)
    write(torch.randn(0, L), torch.randn(0, R), cache, torch.zeros(0, dtype=torch.int64), None, "fp8_ds")
    assert torch.equal(_bytes(cache), before)


def test_write_non_contiguous_inputs_and_cache():
    kv = torch.randn(4, L + R + 8)
    kv_c, k_pe = kv[:, :L], kv[:, L + 8 :]
    slots = torch.tensor([[3, 0], [9, 0], [-1, 0], [12, 0]])[:, 0]
    big = _cache("bf16", torch.float32, pages=2 * PAGES)
    wide = torch.randn(PAGES, PAGE, L + R + 5)
    for cache in (big[PAGES:], wide[..., 5:]):  # a page slice; a row slice of a wider buffer
        before = cache.clone()
        write(kv_c, k_pe, cache, slots, None, "bf16")
        _check_written("bf16", before, cache, kv_c, k_pe, slots, torch.float32)
    assert not wide[..., 5:].is_contiguous()


@pytest.mark.parametrize("layout, dtype, cache_dtype", VARIANTS, ids=IDS)
def test_write_opcheck(layout, dtype, cache_dtype):
    args = (torch.randn(5, L, dtype=dtype), torch.randn(5, R, dtype=dtype), _cache(layout, cache_dtype),
            torch.tensor([3, -1, 7, 8, 2]), _scale(layout), layout)
    helpers.opcheck(write, args)


def test_write_compile_dynamic():
    def fn(kv_c, k_pe, cache, slots, scale):
        write(kv_c * 2, k_pe, cache, slots, scale, "fp8")
        return cache.float().sum()

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
    for t in (3, 5):
        kv_c, k_pe = torch.randn(t, L), torch.randn(t, R)
        slots = torch.randperm(PAGES * PAGE)[:t]
        slots[1] = -1
        c_eager, c_compiled = _cache("fp8", torch.float8_e4m3fn), None
        c_compiled = c_eager.clone()
        fn(kv_c, k_pe, c_eager, slots, _scale("fp8"))
        compiled(kv_c, k_pe, c_compiled, slots, _scale("fp8"))
        assert torch.equal(_bytes(c_eager), _bytes(c_compiled))


def _bad_write_cases():
    t = 4
    kv_c, k_pe = torch.randn(t, L), torch.randn(t, R)
    slots = torch.tensor([1, 2, 3, 4])
    ds = _cache("fp8_ds", torch.uint8)
    fp8 = _cache("fp8", torch.float8_e4m3fn)
    bf = _cache("bf16", torch.float32)
    meta = torch.device("meta")
    return [
        ("layout", (kv_c, k_pe, bf, slots, None, "fp16")),
        ("kv_c", (kv_c[0], k_pe, bf, slots, None, "bf16")),
        ("kv_c", (kv_c.double(), k_pe.double(), bf, slots, None, "bf16")),
        ("kv_c", (kv_c[:, :192], k_pe, _cache("fp8_ds", torch.uint8, latent=256), slots, None, "fp8_ds")),
        ("k_pe", (kv_c, k_pe[:3], bf, slots, None, "bf16")),
        ("k_pe", (kv_c, k_pe[None], bf, slots, None, "bf16")),
        ("k_pe", (kv_c, k_pe.bfloat16(), bf, slots, None, "bf16")),
        ("k_pe", (kv_c, k_pe.to(meta), bf, slots, None, "bf16")),
        ("kv_cache", (kv_c, k_pe, bf[0], slots, None, "bf16")),
        ("kv_cache", (kv_c, k_pe, bf, slots, None, "fp8_ds")),  # wrong dtype for the layout
        ("kv_cache", (kv_c, k_pe, fp8, slots, _scale("fp8"), "bf16")),
        ("kv_cache", (kv_c, k_pe, ds[..., :-2], slots, None, "fp8_ds")),  # wrong width
        ("kv_cache", (kv_c, k_pe, bf[..., :-1], slots, None, "bf16")),
        ("kv_cache", (kv_c, k_pe, bf[:, :2], slots, None, "bf16")),  # pages/slots not mergeable
        ("kv_cache", (kv_c, k_pe, bf.to(meta), slots, None, "bf16")),
        ("slot_mapping", (kv_c, k_pe, bf, slots[:3], None, "bf16")),
        ("slot_mapping", (kv_c, k_pe, bf, slots.float(), None, "bf16")),
        ("slot_mapping", (kv_c, k_pe, bf, slots.to(meta), None, "bf16")),
        ("scale", (kv_c, k_pe, fp8, slots, None, "fp8")),
        ("scale", (kv_c, k_pe, fp8, slots, torch.tensor([1.0, 2.0]), "fp8")),
        ("scale", (kv_c, k_pe, fp8, slots, torch.tensor([1.0], dtype=torch.float64), "fp8")),
        ("scale", (kv_c, k_pe, fp8, slots, torch.tensor([1.0], device=meta), "fp8")),
    ]


@pytest.mark.parametrize("case", range(len(_bad_write_cases())))
def test_write_bad_input(case):
    arg, args = _bad_write_cases()[case]
    cache = args[2]
    before = _bytes(cache) if cache.device.type != "meta" else None
    assert_value_error(write, args, arg_error(arg))
    if before is not None:
        assert torch.equal(_bytes(cache), before)


def test_write_rejects_576_wide_cache_as_fp8_ds():
    """Lesson 5: a raw 576-wide fp8 cache must never be taken for the 656-byte layout."""
    kv_c, k_pe = torch.randn(2, 512), torch.randn(2, 64)
    cache = torch.zeros(2, 4, 576, dtype=torch.uint8)
    assert_value_error(write, (kv_c, k_pe, cache, torch.tensor([0, 1]), None, "fp8_ds"), arg_error("kv_cache"))
    assert not cache.any()


# ---------------------------------------------------------------------------------------------
# read


SEQ_LENS = [5, 0, 9, 1]  # ragged, one empty request, page-boundary crossings (PAGE = 4)


def test_read_page_mapping_against_loop():
    """Reads a cache of random rows; the expected rows come from a per-token loop."""
    block_table = make_block_table(SEQ_LENS, PAGE, PAGES, seed=3)
    cu = torch.tensor([0] + torch.tensor(SEQ_LENS).cumsum(0).tolist(), dtype=torch.int32)
    cache = torch.randn(PAGES, PAGE, L + R)
    kv_c, k_pe = read(cache, block_table, cu, None, "bf16", R, torch.float32, sum(SEQ_LENS))
    flat = cache.view(-1, L + R)
    n = 0
    for b, length in enumerate(SEQ_LENS):
        for pos in range(length):
            slot = int(block_table[b, pos // PAGE]) * PAGE + pos % PAGE
            assert torch.equal(kv_c[n], flat[slot, :L]) and torch.equal(k_pe[n], flat[slot, L:])
            n += 1
    assert kv_c.shape == (n, L) and k_pe.shape == (n, R)


@pytest.mark.parametrize("layout, dtype, cache_dtype", VARIANTS, ids=IDS)
def test_write_read_round_trip(layout, dtype, cache_dtype):
    block_table = make_block_table(SEQ_LENS, PAGE, PAGES, seed=1)
    total = sum(SEQ_LENS)
    kv_c, k_pe = torch.randn(total, L, dtype=dtype), torch.randn(total, R, dtype=dtype)
    slots = torch.tensor(
        [s for b, n in enumerate(SEQ_LENS) for s in slots_for(block_table, PAGE, b, range(n))], dtype=torch.int64
    )
    cache = _cache(layout, cache_dtype)
    write(kv_c, k_pe, cache, slots, _scale(layout), layout)
    cu = torch.tensor([0] + torch.tensor(SEQ_LENS).cumsum(0).tolist(), dtype=torch.int32)
    out_kv, out_pe = read(cache, block_table, cu, _scale(layout), layout, R, dtype, total)
    assert out_kv.dtype == dtype and out_pe.dtype == dtype and out_kv.shape == (total, L)
    if layout == "bf16":
        assert torch.equal(out_kv, kv_c.to(cache_dtype).to(dtype)) and torch.equal(out_pe, k_pe.to(cache_dtype).to(dtype))
    elif layout == "fp8":
        _check_fp8(out_kv.double(), kv_c.double(), FP8_SCALE)
        _check_fp8(out_pe.double(), k_pe.double(), FP8_SCALE)
    else:
        for n in range(total):
            for g in range(L // 128):
                want = kv_c[n, g * 128 : (g + 1) * 128].double()
                _check_fp8(out_kv[n, g * 128 : (g + 1) * 128].double(), want, float(want.abs().max()) / 448)
        assert torch.equal(out_pe, k_pe.to(torch.bfloat16).to(dtype))


def test_deepseek_dims_fp8_ds_656_byte_rows():
    block_table = make_block_table([6, 3], 4, 6, seed=2)
    kv_c, k_pe = torch.randn(9, 512, dtype=torch.bfloat16), torch.randn(9, 64, dtype=torch.bfloat16)
    slots = torch.tensor(slots_for(block_table, 4, 0, range(6)) + slots_for(block_table, 4, 1, range(3)))
    cache = torch.randint(0, 256, (6, 4, 656), dtype=torch.uint8)
    before = cache.clone()
    write(kv_c, k_pe, cache, slots, None, "fp8_ds")
    _check_written("fp8_ds", before, cache, kv_c, k_pe, slots, torch.uint8)
    out_kv, out_pe = read(cache, block_table, torch.tensor([0, 6, 9], dtype=torch.int32), None, "fp8_ds", 64, torch.bfloat16, 9)
    assert out_kv.shape == (9, 512) and torch.equal(out_pe, k_pe)
    torch.testing.assert_close(out_kv.float(), kv_c.float(), atol=0.02, rtol=0.07)


def test_read_outputs_do_not_alias():
    cache = torch.randn(2, 4, L + R)
    block_table = torch.tensor([[1, 0]], dtype=torch.int32)
    for n in (1, 3):
        kv_c, k_pe = read(cache, block_table, torch.tensor([0, n], dtype=torch.int32), None, "bf16", R, torch.float32, n)
        assert kv_c.untyped_storage().data_ptr() != k_pe.untyped_storage().data_ptr()
        assert kv_c.untyped_storage().data_ptr() != cache.untyped_storage().data_ptr()


def _read_args(layout, cache_dtype, out_dtype=torch.float32):
    block_table = make_block_table(SEQ_LENS, PAGE, PAGES, seed=4)
    cu = torch.tensor([0] + torch.tensor(SEQ_LENS).cumsum(0).tolist(), dtype=torch.int32)
    return (_cache(layout, cache_dtype), block_table, cu, _scale(layout), layout, R, out_dtype, sum(SEQ_LENS))


@pytest.mark.parametrize("layout, dtype, cache_dtype", VARIANTS, ids=IDS)
def test_read_opcheck(layout, dtype, cache_dtype):
    args = _read_args(layout, cache_dtype, dtype)
    if layout == "fp8_ds":  # random bytes may hold NaN scales; make them finite for the check
        args = (_written_ds_cache(), *args[1:])
    helpers.opcheck(read, args)


def _written_ds_cache():
    cache = torch.zeros(PAGES, PAGE, layouts.latent_row_width("fp8_ds", L, R), dtype=torch.uint8)
    write(torch.randn(PAGES * PAGE, L), torch.randn(PAGES * PAGE, R), cache, torch.arange(PAGES * PAGE), None, "fp8_ds")
    return cache


def test_read_compile_dynamic():
    def fn(cache, block_table, cu, num_tokens):
        kv_c, k_pe = read(cache, block_table, cu, None, "fp8_ds", R, torch.bfloat16, num_tokens)
        return kv_c.float() + 1, k_pe * 2

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
    cache = _written_ds_cache()
    for lens in ([5, 0, 9, 1], [3, 7]):
        block_table = make_block_table(lens, PAGE, PAGES, seed=5)
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        for got, want in zip(compiled(cache, block_table, cu, sum(lens)), fn(cache, block_table, cu, sum(lens))):
            assert torch.equal(got, want)


def _bad_read_cases():
    cache, bt, cu, _, _, _, _, n = _read_args("bf16", torch.float32)
    fp8 = _cache("fp8", torch.float8_e4m3fn)
    meta = torch.device("meta")
    s = torch.tensor([FP8_SCALE])
    return [
        ("layout", (cache, bt, cu, None, "int8", R, torch.float32, n)),
        ("rope_dim", (cache, bt, cu, None, "bf16", 0, torch.float32, n)),
        ("kv_cache", (cache, bt, cu, None, "bf16", L + R, torch.float32, n)),  # no latent left
        ("kv_cache", (cache[0], bt, cu, None, "bf16", R, torch.float32, n)),
        ("kv_cache", (cache.double(), bt, cu, None, "bf16", R, torch.float32, n)),
        ("kv_cache", (cache, bt, cu, s, "fp8", R, torch.float32, n)),  # float32 cache read as fp8
        ("kv_cache", (torch.zeros(2, 4, 576, dtype=torch.uint8), bt, cu, None, "fp8_ds", 64, torch.float32, n)),
        ("kv_cache", (torch.zeros(2, 4, 655, dtype=torch.uint8), bt, cu, None, "fp8_ds", 64, torch.float32, n)),
        ("block_table", (cache, bt.long(), cu, None, "bf16", R, torch.float32, n)),
        ("block_table", (cache, bt[0], cu, None, "bf16", R, torch.float32, n)),
        ("block_table", (cache, bt.to(meta), cu, None, "bf16", R, torch.float32, n)),
        ("cu_seq_lens", (cache, bt, cu[:-1], None, "bf16", R, torch.float32, n)),
        ("cu_seq_lens", (cache, bt, cu.long(), None, "bf16", R, torch.float32, n)),
        ("cu_seq_lens", (cache, bt, cu.to(meta), None, "bf16", R, torch.float32, n)),
        ("scale", (fp8, bt, cu, None, "fp8", R, torch.float32, n)),
        ("scale", (fp8, bt, cu, s.half(), "fp8", R, torch.float32, n)),
        ("out_dtype", (cache, bt, cu, None, "bf16", R, torch.int32, n)),
        ("out_dtype", (cache, bt, cu, None, "bf16", R, torch.float64, n)),
        ("num_tokens", (cache, bt, cu, None, "bf16", R, torch.float32, -1)),
    ]


@pytest.mark.parametrize("case", range(len(_bad_read_cases())))
def test_read_bad_input(case):
    arg, args = _bad_read_cases()[case]
    assert_value_error(read, args, arg_error(arg))


# ---------------------------------------------------------------------------------------------
# fused RoPE -> concat -> write

TF, HF, DN = 5, 2, 12


def _fused_args(layout, dtype, cache_dtype, interleaved, latent=L, rope_dim=R):
    q_nope = torch.randn(TF, HF, DN, dtype=dtype)
    q_pe = torch.randn(TF, HF, rope_dim, dtype=dtype)
    kv_c = torch.randn(TF, latent, dtype=dtype)
    k_pe = torch.randn(TF, 1, rope_dim, dtype=dtype)
    positions = torch.tensor([0, 3, 1, 40, 7])
    table = rope_cos_sin_cache(rope_dim, 64, 10000.0, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 1.2})
    cache = _cache(layout, cache_dtype, latent=latent, rope_dim=rope_dim)
    slots = torch.tensor([6, -1, 0, 13, 30])  # the last row (31) is never a target
    return (q_nope, q_pe, kv_c, k_pe, positions, table, cache, slots, _scale(layout), layout, interleaved)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("layout, dtype, cache_dtype", VARIANTS, ids=IDS)
def test_fused_equals_composition(layout, dtype, cache_dtype, interleaved):
    args = _fused_args(layout, dtype, cache_dtype, interleaved)
    q_nope, q_pe, kv_c, k_pe, positions, table, cache, slots, scale, _, _ = args
    cache_ref = cache.clone()
    q, k = fused(*args)
    q_rot, k_rot = rope(q_pe, k_pe, positions, table, interleaved)
    write(kv_c, k_rot[:, 0], cache_ref, slots, scale, layout)
    assert torch.equal(q, torch.cat([q_nope, q_rot], -1)) and torch.equal(k, k_rot)
    assert torch.equal(_bytes(cache), _bytes(cache_ref))
    assert q.shape == (TF, HF, DN + R) and k.shape == (TF, 1, R) and q.dtype == dtype == k.dtype


def test_fused_rotates_the_cached_key():
    """The cache holds the ROTATED k_pe (a fused kernel that caches k_pe as given is wrong)."""
    args = _fused_args("bf16", torch.float32, torch.float32, True)
    _, _, kv_c, k_pe, positions, table, cache, slots, _, _, _ = args
    before = cache.clone()
    fused(*args)
    half = R // 2
    k_rot = torch.empty(TF, R, dtype=torch.float64)
    for t in range(TF):
        c, s = table[positions[t], :half].double(), table[positions[t], half:].double()
        x = k_pe[t, 0].double()
        k_rot[t, 0::2] = x[0::2] * c - x[1::2] * s
        k_rot[t, 1::2] = x[1::2] * c + x[0::2] * s
    flat, flat_before = cache.view(-1, L + R), before.view(-1, L + R)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat[s, :L], kv_c[t])
            torch.testing.assert_close(flat[s, L:].double(), k_rot[t], atol=1e-6, rtol=1e-6)
    untouched = sorted(set(range(PAGES * PAGE)) - set(slots.tolist()))
    assert torch.equal(flat[untouched], flat_before[untouched])  # includes row 31: slot -1 skipped


def test_fused_deepseek_dims_fp8_ds():
    args = _fused_args("fp8_ds", torch.bfloat16, torch.uint8, True, latent=512, rope_dim=64)
    assert args[6].shape[-1] == 656
    before = args[6].clone()
    q, k = fused(*args)
    _check_written("fp8_ds", before, args[6], args[2], k[:, 0], args[7], torch.uint8)
    assert q.shape == (TF, HF, DN + 64)


@pytest.mark.parametrize("layout, dtype, cache_dtype", [VARIANTS[1], VARIANTS[3], VARIANTS[4]], ids=[IDS[1], IDS[3], IDS[4]])
def test_fused_opcheck(layout, dtype, cache_dtype):
    helpers.opcheck(fused, _fused_args(layout, dtype, cache_dtype, layout != "fp8"))


def test_fused_compile_dynamic():
    def fn(*args):
        q, k = fused(*args)
        return q.sum(-1), k * 2

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
    for t in (3, 5):
        args = list(_fused_args("fp8_ds", torch.bfloat16, torch.uint8, True))
        for i in (0, 1, 2, 3, 4, 7):
            args[i] = args[i][:t]
        args_c = list(args)
        args_c[6] = args[6].clone()
        for got, want in zip(compiled(*args_c), fn(*args)):
            assert torch.equal(got, want)
        assert torch.equal(args_c[6], args[6])


def _bad_fused_cases():
    (q_nope, q_pe, kv_c, k_pe, pos, table, cache, slots, _, _, _) = _fused_args("bf16", torch.float32, torch.float32, True)
    fp8 = _cache("fp8", torch.float8_e4m3fn)
    meta = torch.device("meta")

    def a(**kw):
        d = dict(q_nope=q_nope, q_pe=q_pe, kv_c=kv_c, k_pe=k_pe, positions=pos, cos_sin_cache=table,
                 kv_cache=cache, slot_mapping=slots, scale=None, layout="bf16", interleaved=True)
        return tuple((d | kw).values())

    return [
        ("q_nope", a(q_nope=q_nope[0])),
        ("q_nope", a(q_nope=q_nope.long())),
        ("q_pe", a(q_pe=q_pe[:, :1])),
        ("q_pe", a(q_pe=q_pe[:4])),
        ("q_pe", a(q_pe=q_pe.bfloat16())),
        ("q_pe", a(q_pe=q_pe.to(meta))),
        ("q_pe", a(q_pe=q_pe[..., :7], k_pe=k_pe[..., :7], cos_sin_cache=table[:, :7])),
        ("k_pe", a(k_pe=k_pe[:, 0])),
        ("k_pe", a(k_pe=k_pe.half())),
        ("positions", a(positions=pos[:2])),
        ("positions", a(positions=pos.float())),
        ("cos_sin_cache", a(cos_sin_cache=table[:, :4])),
        ("cos_sin_cache", a(cos_sin_cache=table.double())),
        ("layout", a(layout="fp8_e5m2")),
        ("kv_c", a(kv_c=kv_c[:3])),
        ("kv_c", a(kv_c=kv_c.to(meta))),
        ("kv_c", a(kv_c=kv_c.bfloat16())),
        ("kv_c", a(kv_c=kv_c[:, :100], layout="fp8_ds", kv_cache=_cache("fp8_ds", torch.uint8))),
        ("kv_cache", a(kv_cache=cache[..., :-1])),
        ("kv_cache", a(kv_cache=_cache("fp8_ds", torch.uint8)[..., :-4], layout="fp8_ds")),
        ("kv_cache", a(kv_cache=fp8)),
        ("slot_mapping", a(slot_mapping=slots[:4])),
        ("slot_mapping", a(slot_mapping=slots.to(torch.int16))),
        ("scale", a(kv_cache=fp8, layout="fp8")),
    ]


@pytest.mark.parametrize("case", range(len(_bad_fused_cases())))
def test_fused_bad_input(case):
    arg, args = _bad_fused_cases()[case]
    cache = args[6]
    before = _bytes(cache)
    assert_value_error(fused, args, arg_error(arg))
    assert torch.equal(_bytes(cache), before)


@pytest.mark.parametrize("layout, dtype, cache_dtype", VARIANTS, ids=IDS)
def test_no_host_sync(layout, dtype, cache_dtype):
    """Each op's Python body (checks + reference) under a mode that fails on host syncs."""
    fused_args = _fused_args(layout, dtype, cache_dtype, True)
    read_args = _read_args(layout, cache_dtype, dtype)
    with NoHostSync():
        q, k = op_body("mlagraph::fused_rope_concat_cache_write")(*fused_args)
        op_body("mlagraph::latent_cache_write")(fused_args[2], k[:, 0], *fused_args[6:10])
        op_body("mlagraph::latent_cache_write")(fused_args[2], k[:, 0], fused_args[6], torch.full((TF,), -1), *fused_args[8:10])
        op_body("mlagraph::latent_cache_read")(*read_args)
