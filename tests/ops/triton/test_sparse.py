"""The triton backend's sparse_mla against the reference op (mlagraph::sparse_mla).

Caches are written with the layouts helpers into a cache whose unwritten rows are NaN (all-ones
bytes for fp8_ds), so a -1 index, a position past the block table, a -1 page or a wrong slot
that is read instead of skipped poisons the output. CPU cases run Triton's interpreter on tiny
shapes (L=128, R=32, 3 heads, top-k 8 and 37 over 16-key blocks); the cuda cases add DeepSeek
sizes (L=512, R=64, H=16/20/128, page_size 64, top-k 256 and 2048 over contexts up to 3000) and
a CUDA-graph capture and replay.
"""

from __future__ import annotations

import importlib
import math
import random

import pytest
import torch

from tests import helpers
from tests.helpers import arg_error, assert_value_error, capture_cuda_graph
from tests.ops.test_decode import CACHE_KINDS, SM_SCALE
from tests.ops.triton.test_decode import make_cache

# DeepSeek-sized shapes run on the GPU only (the CPU interpreter would take minutes).
GPU_ONLY = pytest.mark.parametrize("device", [pytest.param(torch.device("cuda"), marks=pytest.mark.gpu, id="cuda")])

triton_sparse = torch.ops.mlagraph_triton.sparse_mla
ref_sparse = torch.ops.mlagraph.sparse_mla

L, R, H = 128, 32, 3  # tiny shapes for the interpreter (fp8_ds needs L divisible by 128)
# SM_SCALE and the cache kinds are the reference op tests' (tests/ops/test_decode.py); make_cache the
# triton decode tests' (the same NaN-poisoned paged caches).
SEQ_LENS = [6, 21, 0, 40]
# (request, position) of each token, requests interleaved; request 2 is padding (selects nothing)
TOKENS = [(0, 5), (1, 0), (1, 20), (3, 39), (3, 7), (2, 0), (1, 13), (3, 25)]
EMPTY = (5,)  # tokens whose row is all -1
SMALL = {"BLOCK_H": 16, "BLOCK_N": 16}
WIDE = {"BLOCK_H": 16, "BLOCK_N": 32}


def kernels():
    """The kernel module (imported lazily, after conftest has set TRITON_INTERPRET)."""
    return importlib.import_module("mlagraph.ops.triton.sparse")


def make_topk(tokens, k, *, seed=0, empty=EMPTY) -> torch.Tensor:
    """[T, k] int32: distinct random visible positions (<= the token's own), -1 anywhere in the
    rest of the row; the tokens in ``empty`` select nothing."""
    rng = random.Random(seed)
    rows = []
    for t, (_, pos) in enumerate(tokens):
        picked = [] if t in empty else rng.sample(range(pos + 1), min(k, pos + 1))
        row = picked + [-1] * (k - len(picked))
        rng.shuffle(row)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int32).reshape(len(tokens), k)


def sparse_args(kind, *, k=8, page_size=16, seq_lens=SEQ_LENS, tokens=TOKENS, heads=H, latent=L, rope=R,
                q_dtype=torch.float32, seed=0, empty=EMPTY):
    """The op's arguments; q_nope and q_pe are non-contiguous slices of one tensor (as the model
    makes them)."""
    cache, scale, table = make_cache(kind, seq_lens, page_size, latent=latent, rope=rope, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(tokens), heads, latent + rope, generator=g).to(q_dtype)
    topk = make_topk(tokens, k, seed=seed, empty=empty)
    req_ids = torch.tensor([r for r, _ in tokens], dtype=torch.int32)
    return [q[..., :latent], q[..., latent:], cache, topk, req_ids, table, scale, CACHE_KINDS[kind][0], SM_SCALE]


def on(device, args):
    return [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]


def run(args, device, config=None):
    """The triton op (default config) or the kernel module with a config override, on ``device``."""
    dev_args = on(device, args)
    out, lse = triton_sparse(*dev_args) if config is None else kernels().sparse_mla(*dev_args, config=config)
    assert out.is_contiguous() and lse.is_contiguous()
    return out, lse


def check(args, device, *, config=None, tol=1e-4, ref_device="cpu"):
    """Runs the kernel and compares with the reference op (on ``ref_device``); returns (out, lse)."""
    want_out, want_lse = (x.cpu() for x in ref_sparse(*on(ref_device, args)))
    out, lse = (x.cpu() for x in run(args, device, config))
    assert out.dtype == args[0].dtype and lse.dtype == torch.float32
    assert out.shape == want_out.shape and lse.shape == want_lse.shape
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))  # the same tokens see no key
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out.float(), want_out.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse, want_lse, atol=tol, rtol=tol)
    return out, lse


def assert_empty(out, lse, tokens=EMPTY):
    for t in tokens:
        assert torch.all(out[t] == 0) and torch.all(lse[t] == -math.inf)


# ---------------------------------------------------------------------------------------------
# tiny shapes (interpreter on CPU; compiled on cuda)


@pytest.mark.parametrize("k", [8, 37])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kind", list(CACHE_KINDS))
def test_matches_reference(device, kind, page_size, k):
    out, lse = check(sparse_args(kind, k=k, page_size=page_size), device)
    assert_empty(out, lse)


@pytest.mark.parametrize("config", [SMALL, WIDE], ids=["h16n16", "h16n32"])
@pytest.mark.parametrize("kind", ["bf16-f32", "fp8_ds"])
def test_other_block_sizes(device, kind, config):
    check(sparse_args(kind, k=37, page_size=4), device, config=config)


@pytest.mark.parametrize("kind", list(CACHE_KINDS))
def test_bf16_queries(device, kind):
    # bf16 dots with float32 accumulation: float32 / fp8_ds latents round to bf16 for the dot,
    # p and out round to bf16.
    out, lse = check(sparse_args(kind, k=37, q_dtype=torch.bfloat16), device, tol=2e-2)
    assert_empty(out, lse)


def test_float16_queries(device):
    check(sparse_args("fp8", k=8, q_dtype=torch.float16), device, tol=2e-2)


def test_indices_without_a_page_are_skipped(device):
    """Positions past the block table's reach, or on a -1 page, are ignored like -1: never an
    out-of-range read, never a clamped neighbour, never the row a -1 slot would wrap to."""
    args = sparse_args("bf16-f32", k=8)
    table, page_size = args[5], args[2].shape[1]
    table[0, 1:] = -1  # request 0 (6 keys) has only page 0
    want = run(args, device)
    bad = args[3].clone()
    bad[0, bad[0] == -1] = 20  # request 0: position 20 is on a -1 page
    bad[3, bad[3] == -1] = table.shape[1] * page_size  # one past the table
    bad[5, 0] = 2**31 - 1
    got = run([*args[:3], bad, *args[4:]], device)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_no_tokens_and_no_indices(device):
    args = sparse_args("fp8_ds", k=8)
    out, lse = run([args[0][:0], args[1][:0], args[2], args[3][:0], args[4][:0], *args[5:]], device)
    assert out.shape == (0, H, L) and lse.shape == (0, H)
    out, lse = check([*args[:3], args[3][:, :0], *args[4:]], device)
    assert torch.all(out == 0) and torch.all(lse == -math.inf)


def test_non_contiguous_cache_and_metadata(device):
    args = sparse_args("fp8_ds", k=37, page_size=4)
    want = run(args, device)
    dev_args = on(device, args)
    cache, topk, table = dev_args[2], dev_args[3], dev_args[5]
    # A layer's cache as a view into an interleaved [pages, layers, page_size, W] allocation.
    both = torch.full((cache.shape[0], 2, *cache.shape[1:]), 255, dtype=torch.uint8, device=device)
    both[:, 1] = cache
    dev_args[2], dev_args[3], dev_args[5] = both[:, 1], topk.t().contiguous().t(), table.t().contiguous().t()
    assert not any(dev_args[i].is_contiguous() for i in (2, 3, 5))
    got = triton_sparse(*dev_args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ---------------------------------------------------------------------------------------------
# op contract: bad input, opcheck


def test_bad_input():
    args = sparse_args("fp8", k=8)
    args[1] = args[1][:, :1]  # q_pe's heads differ from q_nope's
    assert_value_error(triton_sparse, args, arg_error("q_pe"))


@pytest.mark.parametrize("kind", ["bf16", "fp8", "fp8_ds"])
def test_opcheck(kind):
    helpers.opcheck(triton_sparse, sparse_args(kind, k=8, page_size=4))


# ---------------------------------------------------------------------------------------------
# DeepSeek sizes (cuda only)

DS_L, DS_R, DS_PAGE, DS_SCALE = 512, 64, 64, 0.135234
DS_LENS = [3000, 0, 700, 2100, 1]




def ds_tokens(num=48, seed=0):
    """Tokens spread over the live requests, early and late positions, one padding token."""
    rng = random.Random(seed)
    live = [b for b, n in enumerate(DS_LENS) if n]
    tokens = [(b, DS_LENS[b] - 1) for b in live] + [(1, 0)]
    while len(tokens) < num:
        b = rng.choice(live)
        tokens.append((b, rng.randrange(DS_LENS[b])))
    return tokens


def ds_args(kind, heads, k, *, seed=0):
    tokens = ds_tokens(seed=seed)
    args = sparse_args(kind, k=k, page_size=DS_PAGE, seq_lens=DS_LENS, tokens=tokens, heads=heads, latent=DS_L,
                       rope=DS_R, q_dtype=torch.bfloat16, seed=seed, empty=(len(DS_LENS) - 1,))
    args[8] = DS_SCALE
    return args


@pytest.mark.parametrize("k", [256, 2048])
@pytest.mark.parametrize("heads", [16, 20, 128])
@pytest.mark.parametrize("kind", ["bf16", "fp8", "fp8_ds"])
@GPU_ONLY
def test_deepseek_shapes(device, kind, heads, k):
    # fp8_ds: e4m3 latents and bf16 queries; one output in millions landed 0.021 from the reference
    out, lse = check(ds_args(kind, heads, k), device, tol=3e-2 if kind == "fp8_ds" else 2e-2, ref_device=device)
    assert_empty(out, lse, tokens=(len(DS_LENS) - 1,))


@pytest.mark.parametrize("config", [{"BLOCK_N": 64}, {"BLOCK_N": 16, "num_stages": 3}], ids=["n64", "n16s3"])
@GPU_ONLY
def test_deepseek_shapes_other_configs(device, config):
    check(ds_args("bf16", 128, 2048), device, config=config, tol=2e-2, ref_device=device)


@pytest.mark.parametrize("config", [{"num_stages": 1}, {"num_stages": 2}, {"SEESAW": True}],
                         ids=["one_stage", "two_stages", "seesaw"])
@pytest.mark.parametrize("k", [37, 150, 256, 2048])
@pytest.mark.parametrize("heads", [16, 64, 128])
@GPU_ONLY
def test_deepseek_shapes_wgmma(device, heads, k, config):
    """The Gluon forms (sparse_wgmma; seesaw's sparse kernel) on Hopper: -1 indices among the
    selected keys, a token that selects nothing, a top-k that is not a multiple of 64 (37: one
    partial block; 150: three blocks, the seesaw's last pair with one), 16 heads padded into the
    64-row tile."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon form is sm_90 only")
    out, lse = check(ds_args("bf16", heads, k), device, config={"FORM": "wgmma", **config}, tol=2e-2,
                     ref_device=device)
    assert_empty(out, lse, tokens=(len(DS_LENS) - 1,))


@pytest.mark.parametrize("k", [37, 150, 2048])
@pytest.mark.parametrize("heads", [16, 128])
@GPU_ONLY
def test_deepseek_shapes_wgmma_fp8_ds(device, heads, k):
    """The Gluon kernel that widens fp8_ds rows into a bf16 tile (sparse_wgmma._sparse_ds_kernel),
    opt-in: -1 indices, a token that selects nothing, partial last blocks, padded heads."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon form is sm_90 only")
    out, lse = check(ds_args("fp8_ds", heads, k), device, config={"FORM": "wgmma"}, tol=3e-2, ref_device=device)
    assert_empty(out, lse, tokens=(len(DS_LENS) - 1,))


def test_wgmma_form_is_checked():
    """Asked for where it cannot run (here: on CPU), the Gluon form says why; other keys with it
    are refused."""
    args = sparse_args("bf16", q_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="FORM 'wgmma' asked for, but it needs a Hopper GPU"):
        kernels().sparse_mla(*args, config={"FORM": "wgmma"})
    with pytest.raises(ValueError, match="FORM must be 'rows' or 'wgmma'"):
        kernels().sparse_mla(*args, config={"FORM": "cols"})
    with pytest.raises(ValueError, match="SEESAW takes num_stages 2 \\(a pair of key blocks\\), got 1"):
        kernels().sparse_mla(*args, config={"FORM": "wgmma", "SEESAW": True, "num_stages": 1})
    with pytest.raises(ValueError, match=r"takes only num_stages and SEESAW, got \['BLOCK_N'\]"):
        kernels().sparse_mla(*args, config={"FORM": "wgmma", "BLOCK_N": 32})
    ds = sparse_args("fp8_ds", q_dtype=torch.bfloat16, latent=128)
    with pytest.raises(ValueError, match=r"with an fp8_ds cache takes no other keys, got \['num_stages'\]"):
        kernels().sparse_mla(*ds, config={"FORM": "wgmma", "num_stages": 2})
    with pytest.raises(ValueError, match="FORM 'wgmma' asked for, but it needs a Hopper GPU"):
        kernels().sparse_mla(*ds, config={"FORM": "wgmma"})


def test_wgmma_kernel_builds_for_sm90():
    """Built for sm_90 offline with this machine's Triton, in a child process (see the decode
    twin in test_decode.py): asynchronous copies and warp-group MMAs, nothing else."""
    sparse_wgmma = importlib.import_module("mlagraph.ops.triton.sparse_wgmma")
    if not sparse_wgmma.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    code = ("import json; from mlagraph.ops.triton import sparse_wgmma as s, decode_wgmma as d\n"
            "k = s.compile_for_sm90()\n"
            "ptx = k.asm['ptx']\n"
            "print(json.dumps([ptx.count('wgmma.mma_async'), ptx.count('cp.async'), ptx.count('mma.sync'),"
            " k.metadata.shared, d.shared_bytes(512, 64, 2)]))")
    wgmma, cp_async, mma_sync, shared, budget = helpers.sm90_build_report(code)
    assert wgmma > 0 and cp_async > 0 and mma_sync == 0
    assert 0 < shared <= budget


def test_fp8_ds_kernel_builds_for_sm90():
    """The fp8_ds widening kernel built for sm_90 offline: cp.async gathers, warp-group MMAs, no
    spill, shared memory within an SM's."""
    sparse_wgmma = importlib.import_module("mlagraph.ops.triton.sparse_wgmma")
    if not sparse_wgmma.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    code = ("import json; from mlagraph.ops.triton import sparse_wgmma as s, decode_wgmma as d\n"
            "k = s.compile_ds_for_sm90()\n"
            "ptx = k.asm['ptx']\n"
            "print(json.dumps([ptx.count('wgmma.mma_async'), ptx.count('cp.async'), ptx.count('mma.sync'),"
            " k.metadata.shared, d.SHARED_LIMIT]))")
    wgmma, cp_async, mma_sync, shared, limit = helpers.sm90_build_report(code)
    assert wgmma > 0 and cp_async > 0 and mma_sync == 0
    assert 0 < shared <= limit


def test_seesaw_kernel_builds_for_sm90():
    """The seesaw schedule's sparse kernel (seesaw.py) built for sm_90 offline: gathered by
    asynchronous copies that arrive on mbarriers, warp-group MMAs, the partitions' register
    budgets set, shared memory within its budget."""
    seesaw = importlib.import_module("mlagraph.ops.triton.seesaw")
    if not seesaw.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    code = ("import json; from mlagraph.ops.triton import seesaw as s\n"
            "k = s.compile_sparse_for_sm90()\n"
            "ptx = k.asm['ptx']\n"
            "print(json.dumps([ptx.count('wgmma.mma_async'), ptx.count('cp.async.mbarrier.arrive'),"
            " ptx.count('mma.sync'), ptx.count('setmaxnreg'), k.metadata.shared, s.shared_bytes(512, 64)]))")
    wgmma, arrive, mma_sync, setmaxnreg, shared, budget = helpers.sm90_build_report(code)
    assert wgmma > 0 and arrive > 0 and mma_sync == 0 and setmaxnreg > 0
    assert 0 < shared <= budget


@GPU_ONLY
def test_deepseek_shapes_float32(device):
    args = sparse_args("bf16-f32", k=300, page_size=DS_PAGE, seq_lens=DS_LENS, tokens=ds_tokens(16), heads=16,
                       latent=DS_L, rope=DS_R, empty=())
    check(args, device, tol=1e-4, ref_device=device)


@pytest.mark.parametrize("kind", ["fp8_ds", "bf16"], ids=["triton_form", "gluon_form"])
@GPU_ONLY
def test_cuda_graph_replay_matches_eager(device, kind):
    """Captured once, replayed with new indices and request ids written into the same buffers:
    the grid depends on shapes only, so replay equals eager. fp8_ds runs the Triton kernel; bf16
    at 128 heads on Hopper the Gluon form."""
    args = on(device, ds_args(kind, 128, 2048))
    step = lambda: triton_sparse(*args)  # noqa: E731
    graph, (out, lse) = capture_cuda_graph(step)
    for seed in (0, 1):
        new = ds_args(kind, 128, 2048, seed=seed)
        args[3].copy_(new[3])
        args[4].copy_(new[4])
        graph.replay()
        want = step()
        torch.cuda.synchronize()
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
