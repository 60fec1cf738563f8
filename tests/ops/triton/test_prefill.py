"""The triton backend's mha_prefill against the reference op (mlagraph::mha_prefill), and the
cuDNN peer ``sdpa_prefill`` (GPU only).

CPU cases run Triton's interpreter on tiny shapes with 16 x 16 tiles, so requests span several
query tiles and the causal diagonal cuts through key blocks at every offset; head dims 24 and 48
take the split q.k dot with a masked remainder. The cuda cases add DeepSeek sizes (H = 16 and
128, Dqk 192 = 128 + 64, Dv 128, ragged requests up to 2000 tokens, with and without a cached
prefix) and a CUDA-graph capture and replay.
"""

from __future__ import annotations

import importlib
import itertools
import math

import pytest
import torch

import mlagraph.ops.triton as triton_backend  # registers torch.ops.mlagraph(_triton).*
from tests import helpers
from tests.helpers import arg_error, assert_value_error, capture_cuda_graph

# DeepSeek-sized shapes run on the GPU only (the CPU interpreter would take minutes).
GPU_ONLY = pytest.mark.parametrize("device", [pytest.param(torch.device("cuda"), marks=pytest.mark.gpu, id="cuda")])

triton_prefill = torch.ops.mlagraph_triton.mha_prefill
ref_prefill = torch.ops.mlagraph.mha_prefill

H = 2
SM_SCALE = 0.2
DIMS = {"split": (24, 16), "split_masked_v": (48, 12), "pow2": (16, 16)}  # name -> (Dqk, Dv)
TILES = {"m32n16": {"BLOCK_M": 32, "BLOCK_N": 16}, "m16n32": {"BLOCK_M": 16, "BLOCK_N": 32}}

# name -> (q_lens, k_lens, causal, pad_q, pad_k)
CASES = {
    "no_prefix": ([3, 37, 1], [3, 37, 1], True, 0, 0),
    "prefix": ([5, 20, 2], [29, 20, 40], True, 0, 0),
    "non_causal": ([19, 4], [33, 2], False, 0, 0),
    "empty_middle_request": ([3, 0, 18], [3, 5, 21], True, 0, 0),
    "padding_tokens": ([2, 17], [4, 17], True, 5, 3),
    "fewer_keys_than_queries": ([20], [3], True, 0, 0),
    "only_padding": ([0, 0], [0, 4], True, 3, 0),
    "no_requests": ([], [], True, 3, 2),
}


def kernels():
    """The kernel module (imported lazily, after conftest has set TRITON_INTERPRET)."""
    return importlib.import_module(f"{triton_backend.__name__}.prefill")


def cu(lens) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)


def make_args(q_lens, k_lens, causal=True, *, pad_q=0, pad_k=0, heads=H, dqk=24, dv=16, dtype=torch.float32,
              seed=0):
    """[q, k, v, cu_q, cu_k, scale, causal]; q, k, v are non-contiguous slices (like the model's
    splits); pad_q / pad_k extra rows past the last request stand for padding tokens."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens) + pad_q, heads, dqk + 8, generator=g).to(dtype)[..., :dqk]
    kv = torch.randn(sum(k_lens) + pad_k, heads, dqk + dv, generator=g).to(dtype)
    return [q, kv[..., :dqk], kv[..., dqk:], cu(q_lens), cu(k_lens), SM_SCALE, causal]


def on(device, args):
    return [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]


def run(args, device, config=None):
    """The triton op (default config) or the kernel module with a config override, on ``device``."""
    dev_args = on(device, args)
    out, lse = triton_prefill(*dev_args) if config is None else kernels().mha_prefill(*dev_args, config=config)
    assert out.is_contiguous() and lse.is_contiguous()
    return out, lse


def reference(args, per_request=False):
    """The reference op on the args' device; ``per_request`` runs it one request at a time (big
    GPU cases: its [H, T, S] score matrix would not fit), padding rows filled as the op would."""
    if not per_request:
        return ref_prefill(*args)
    q, k, v, cu_q, cu_k, scale, causal = args
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
    lse = torch.full(q.shape[:2], -math.inf, device=q.device)
    for (q0, q1), (k0, k1) in zip(itertools.pairwise(cu_q.tolist()), itertools.pairwise(cu_k.tolist())):
        if q1 > q0:
            one_q, one_k = (torch.tensor([0, n], dtype=torch.int32, device=q.device) for n in (q1 - q0, k1 - k0))
            out[q0:q1], lse[q0:q1] = ref_prefill(q[q0:q1], k[k0:k1], v[k0:k1], one_q, one_k, scale, causal)
    return out, lse


def check(args, device, *, config=None, tol=1e-4, lse_tol=None, per_request=False):
    """Runs the kernel and compares with the reference op (on CPU unless ``per_request``)."""
    want_out, want_lse = reference(on(device, args) if per_request else args, per_request)
    out, lse = run(args, device, config)
    out, lse, want_out, want_lse = (x.cpu() for x in (out, lse, want_out, want_lse))
    assert out.dtype == args[0].dtype and lse.dtype == torch.float32
    assert out.shape == want_out.shape and lse.shape == want_lse.shape
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))  # the same queries see no key
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out.float(), want_out.float(), atol=tol, rtol=tol)
    lse_tol = tol if lse_tol is None else lse_tol
    torch.testing.assert_close(lse, want_lse, atol=lse_tol, rtol=lse_tol)
    return out, lse


def assert_unseen_are_zero(out, lse, q_lens, k_lens, causal):
    """Padding rows, and queries that see no key (len_k - len_q + i < 0), give out 0, lse -inf."""
    unseen = torch.ones(out.shape[0], dtype=torch.bool)
    row = 0
    for n_q, n_k in zip(q_lens, k_lens):
        for i in range(n_q):
            unseen[row + i] = n_k == 0 or (causal and i + n_k - n_q < 0)
        row += n_q
    assert torch.all(out[unseen] == 0) and torch.all(lse[unseen] == -math.inf)
    assert torch.all(lse[~unseen] > -math.inf)


# ---------------------------------------------------------------------------------------------
# tiny shapes (interpreter on CPU; compiled on cuda)


@pytest.mark.parametrize("dims", list(DIMS))
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(device, case, dims):
    q_lens, k_lens, causal, pad_q, pad_k = CASES[case]
    dqk, dv = DIMS[dims]
    args = make_args(q_lens, k_lens, causal, pad_q=pad_q, pad_k=pad_k, dqk=dqk, dv=dv)
    out, lse = check(args, device)
    assert_unseen_are_zero(out, lse, q_lens, k_lens, causal)


@pytest.mark.parametrize("tiles", list(TILES))
@pytest.mark.parametrize("case", ["no_prefix", "prefix", "non_causal", "padding_tokens", "fewer_keys_than_queries"])
def test_other_tile_sizes(device, case, tiles):
    q_lens, k_lens, causal, pad_q, pad_k = CASES[case]
    args = make_args(q_lens, k_lens, causal, pad_q=pad_q, pad_k=pad_k)
    check(args, device, config=TILES[tiles])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["prefix", "padding_tokens", "non_causal"])
def test_half_precision(device, case, dtype):
    q_lens, k_lens, causal, pad_q, pad_k = CASES[case]
    args = make_args(q_lens, k_lens, causal, pad_q=pad_q, pad_k=pad_k, dtype=dtype)
    # 16-bit dots with float32 accumulation; p and out rounded to 16 bits, lse stays float32.
    check(args, device, tol=2e-2, lse_tol=1e-3)


def test_poisoned_rows_are_never_read(device):
    """NaN in the padding rows of q, k, v and in the keys of a request with no queries changes
    nothing: those rows are masked out or never loaded."""
    q_lens, k_lens = [7, 0, 21], [9, 6, 30]
    args = make_args(q_lens, k_lens, pad_q=4, pad_k=5)
    want = run(args, device)
    q, k, v = (x.clone() for x in args[:3])
    q[sum(q_lens):] = math.nan
    for x in (k, v):
        x[9:15] = math.nan  # request 1's keys
        x[sum(k_lens):] = math.nan
    got = run([q, k, v, *args[3:]], device)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_last_dim_not_unit_stride(device):
    args = make_args([5, 18], [9, 18])
    want = run(args, device)
    q = torch.stack([args[0], torch.full_like(args[0], math.nan)], dim=-1).flatten(-2)[..., ::2]
    assert q.stride(-1) == 2 and torch.equal(q, args[0])
    got = run([q, *args[1:]], device)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ---------------------------------------------------------------------------------------------
# op contract: bad input, opcheck


def test_bad_input():
    args = make_args([3, 5], [4, 5])
    args[1] = args[1][:, :1]  # k's heads differ from q's
    assert_value_error(triton_prefill, args, arg_error("k"))


@pytest.mark.parametrize("case,dtype", [("prefix", torch.float32), ("padding_tokens", torch.bfloat16)])
def test_opcheck(case, dtype):
    q_lens, k_lens, causal, pad_q, pad_k = CASES[case]
    helpers.opcheck(triton_prefill, make_args(q_lens, k_lens, causal, pad_q=pad_q, pad_k=pad_k, dtype=dtype))


# ---------------------------------------------------------------------------------------------
# DeepSeek sizes (cuda only)

DS_DQK, DS_DV, DS_SCALE = 192, 128, 0.135234
# name -> (q_lens, k_lens, causal, pad_q)
DS_CASES = {
    "ragged": ([1, 700, 2000, 129, 0, 64], [1, 700, 2000, 129, 0, 64], True, 0),
    "ragged_prefix": ([300, 1, 1500, 64], [1800, 900, 1500, 1064], True, 37),
    "non_causal": ([100, 513], [700, 513], False, 0),
}
DS_CONFIGS = {"default": None, "m64n64": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}}




def ds_args(case, heads, dtype=torch.bfloat16, seed=0):
    q_lens, k_lens, causal, pad_q = DS_CASES[case]
    args = make_args(q_lens, k_lens, causal, pad_q=pad_q, heads=heads, dqk=DS_DQK, dv=DS_DV, dtype=dtype, seed=seed)
    args[5] = DS_SCALE
    return args


@pytest.mark.parametrize("config", list(DS_CONFIGS))
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("case", list(DS_CASES))
@GPU_ONLY
def test_deepseek_shapes(device, case, heads, config):
    out, lse = check(ds_args(case, heads), device, config=DS_CONFIGS[config], tol=2e-2, lse_tol=1e-3,
                     per_request=True)
    q_lens, k_lens, causal, _ = DS_CASES[case]
    assert_unseen_are_zero(out, lse, q_lens, k_lens, causal)


@GPU_ONLY
def test_deepseek_shapes_float32(device):
    args = make_args([300, 5, 129], [300, 400, 129], pad_q=3, heads=16, dqk=DS_DQK, dv=DS_DV)
    check(args, device, tol=1e-4, per_request=True)


@GPU_ONLY
def test_cuda_graph_replay_matches_eager(device):
    """Captured once, replayed with other request lengths written into the same cu_seqlens
    buffers: the grid depends on shapes only, so replay equals eager."""
    args = on(device, ds_args("ragged_prefix", 16))
    q, k, v, cu_q, cu_k = args[:5]
    step = lambda: triton_prefill(q, k, v, cu_q, cu_k, DS_SCALE, True)  # noqa: E731
    graph, (out, lse) = capture_cuda_graph(step)
    total_q, total_k = q.shape[0] - 37, k.shape[0]
    for q_lens, k_lens in [([300, 1, 1500, 64], [1800, 900, 1500, 1064]),
                           ([total_q - 10, 0, 10, 0], [total_q, 100, 10, total_k - total_q - 110])]:
        cu_q.copy_(cu(q_lens))
        cu_k.copy_(cu(k_lens))
        graph.replay()
        want = step()
        torch.cuda.synchronize()
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
        want_ref = reference(args, per_request=True)
        torch.testing.assert_close(out.float(), want_ref[0].float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse, want_ref[1], atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("n,heads", [(1000, 16), (2048, 128)])
def test_sdpa_prefill_matches_reference(n, heads):
    """cuDNN's causal attention over one request, with its natural-log lse."""
    if not torch.cuda.is_available():
        pytest.fail("gpu tests need a CUDA device")
    args = make_args([n], [n], heads=heads, dqk=DS_DQK, dv=DS_DV, dtype=torch.bfloat16)
    args = [a.contiguous().cuda() if isinstance(a, torch.Tensor) else a for a in args]
    out, lse = kernels().sdpa_prefill(args[0], args[1], args[2], DS_SCALE)
    args[5] = DS_SCALE
    want_out, want_lse = ref_prefill(*args)
    assert out.shape == want_out.shape and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert lse.shape == want_lse.shape and lse.dtype == torch.float32 and lse.is_contiguous()
    torch.testing.assert_close(out.float(), want_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-3)
