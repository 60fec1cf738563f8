"""The flashmla and flashinfer backends on the CPU: registry, capability tables, ``auto``,
argument errors (eagerly and under fake tensors), the per-step plans and the device helpers.
Their kernels run on the H200 (tests/ops/test_flash_kernels.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mlagraph.ops import _paged, auto, backends, host_plan, layouts
from mlagraph.ops import flashinfer as fi_backend, flashmla as fm_backend
from mlagraph.ops.flashinfer import kernels as fi_kernels
from tests.helpers import assert_value_error, make_block_table

BF = torch.bfloat16
ALL = {"reference": True, "triton": True, "aiter": True, "flashmla": True, "flashinfer": True}


def test_both_listed_and_get_says_how_to_install():
    assert backends.names()[-2:] == ["flashmla", "flashinfer"]
    for name, pip in (("flashmla", "mlagraph[flashmla]"), ("flashinfer", "mlagraph[flashinfer]")):
        b = backends.registered()[backends.names().index(name)]
        if b.available:
            pytest.skip(f"{name}'s package is installed here")
        with pytest.raises(ValueError, match=rf"backend '{name}' is not available: .*pip install {pip.replace('[', '.').replace(']', '.')}"):
            backends.get(name)


@pytest.mark.parametrize("caps", [fm_backend.CAPABILITIES, fi_backend.CAPABILITIES], ids=["flashmla", "flashinfer"])
def test_hardware_message_names_what_is_needed(caps):
    assert backends.hardware_problem(caps, "cpu") == (
        "its kernels need an NVIDIA GPU of compute capability sm_90, got device cpu")
    assert backends.hardware_problem(backends.get("triton").capabilities, "cpu") == ""


def test_capability_tables():
    fm, fi = fm_backend.FLASHMLA, fi_backend.FLASHINFER
    assert fm.owned_ops() == {"mlagraph_flashmla::mla_decode", "mlagraph_flashmla::sparse_mla"}
    assert fi.owned_ops() == {"mlagraph_flashinfer::mla_decode", "mlagraph_flashinfer::mha_prefill"}
    for b in (fm, fi):
        c = b.capabilities
        with pytest.raises(dataclasses.FrozenInstanceError):
            c.page_sizes = None
        with pytest.raises(TypeError):
            c.fallbacks["rope"] = "reference"
        # the fused front is triton's: it rotates, writes and returns K; the fusion pass targets it
        assert b.op_names["fused_rope_concat_cache_write"] == "mlagraph_triton::fused_rope_concat_cache_write"
        assert c.fused_applies_rope and c.fused_writes_cache and c.fused_returns_k
        assert c.sm == {90} and c.step_metadata and c.multi_token_decode
        assert c.cuda_graph_safe == frozenset(backends.GENERIC_OPS)
    assert fm.capabilities.page_sizes == {64} and fm.capabilities.preferred_page_size == 64
    assert fm.capabilities.latent_layouts == {"bf16", "fp8_ds"} and not fm.capabilities.decode_q_split
    assert fi.capabilities.page_sizes is None and fi.capabilities.latent_layouts == {"bf16"}
    assert fi.capabilities.decode_q_split and not fi.capabilities.dense_prefill_sdpa


# (sm, installed, layout) -> backends of mla_decode, mha_prefill, sparse_mla
AUTO = [
    (None, ALL, "bf16", ("reference", "reference", "reference")),  # CPU: the oracle
    (90, ALL, "bf16", ("flashmla", "flashinfer", "flashmla")),
    (90, ALL, "fp8_ds", ("flashmla", "flashinfer", "flashmla")),
    (90, ALL, "fp8", ("triton", "flashinfer", "triton")),  # neither library decodes a per-tensor fp8 cache here
    (90, {"triton": True, "flashinfer": True}, "bf16", ("flashinfer", "flashinfer", "triton")),
    (90, {"triton": True, "flashinfer": True}, "fp8_ds", ("triton", "flashinfer", "triton")),
    (90, {"triton": True, "flashmla": True}, "bf16", ("flashmla", "triton", "flashmla")),
    (90, {"triton": True}, "bf16", ("triton", "triton", "triton")),
    (80, ALL, "bf16", ("triton", "triton", "triton")),  # an A100: no sm_90 kernels
    (100, ALL, "bf16", ("triton", "triton", "triton")),
    (90, {"flashmla": True}, "bf16", ("flashmla", "reference", "flashmla")),  # no triton: reference elsewhere
]


@pytest.mark.parametrize("sm,installed,layout,want", AUTO)
def test_auto_dispatch_matrix(sm, installed, layout, want):
    parts = auto.compose(sm, installed, layout)
    assert set(parts) == set(backends.GENERIC_OPS)
    assert (parts["mla_decode"], parts["mha_prefill"], parts["sparse_mla"]) == want
    base = "reference" if sm is None or not installed.get("triton") else "triton"
    assert all(b == base for g, b in parts.items() if g not in auto.PREFERENCE)


TINY = {"mha_prefill": (80, 16), "mla_decode": (96, 64), "sparse_mla": (96, 64)}  # a toy model's widths
DEEPSEEK = {"mha_prefill": (192, 128), "mla_decode": (576, 512), "sparse_mla": (576, 512)}


def test_auto_takes_only_kernels_built_for_the_model_widths():
    assert auto.compose(90, ALL, "bf16", dims=DEEPSEEK) == auto.compose(90, ALL, "bf16")
    parts = auto.compose(90, ALL, "bf16", dims=TINY)
    assert (parts["mla_decode"], parts["mha_prefill"], parts["sparse_mla"]) == ("triton", "triton", "triton")
    # FlashInfer's prefill takes equal widths of 128, not FlashMLA's 576 decode
    parts = auto.compose(90, ALL, "bf16", dims={"mha_prefill": (128, 128), "mla_decode": (576, 512)})
    assert (parts["mla_decode"], parts["mha_prefill"]) == ("flashmla", "flashinfer")
    composed = auto.build(auto.compose(90, ALL, "bf16"))
    assert composed.capabilities.head_dims["mha_prefill"] == fi_backend.PREFILL_HEAD_DIMS
    assert composed.capabilities.head_dims["mla_decode"] == {(576, 512)}


def test_head_dims_problem_names_the_op_and_the_widths():
    fi = fi_backend.CAPABILITIES
    assert backends.head_dims_problem(fi, DEEPSEEK) == ""
    assert backends.head_dims_problem(fi, TINY) == (
        "its mha_prefill kernel is built for (qk, v) head widths [(64, 64), (128, 128), (192, 128), (256, 256)], "
        "got (80, 16)")
    assert backends.head_dims_problem(backends.get("triton").capabilities, TINY) == ""
    with pytest.raises(TypeError):
        fi.head_dims["mha_prefill"] = frozenset()


def test_auto_takes_only_kernels_built_for_the_head_count():
    """FlashMLA's sparse kernels take 64 or 128 heads: a tensor-parallel shard of 16 (V3.2 at
    TP=8) gets triton's sparse MLA, and over fp8_ds rows triton's decode too; its dense bf16
    decode takes any count."""
    dsa = lambda n: {"mha_prefill": n, "mla_decode": n, "sparse_mla": n}  # noqa: E731
    assert auto.compose(90, ALL, "bf16", heads=dsa(128)) == auto.compose(90, ALL, "bf16")
    parts = auto.compose(90, ALL, "bf16", heads=dsa(16))
    assert (parts["mla_decode"], parts["mha_prefill"], parts["sparse_mla"]) == ("flashmla", "flashinfer", "triton")
    parts = auto.compose(90, ALL, "fp8_ds", heads=dsa(16))
    assert (parts["mla_decode"], parts["mha_prefill"], parts["sparse_mla"]) == ("triton", "flashinfer", "triton")
    parts = auto.compose(90, ALL, "fp8_ds", heads=dsa(64))
    assert (parts["mla_decode"], parts["sparse_mla"]) == ("flashmla", "flashmla")
    composed = auto.build(auto.compose(90, ALL, "fp8_ds"))
    assert composed.capabilities.head_counts == {"sparse_mla": {64, 128}, "mla_decode[fp8_ds]": {64, 128}}
    # triton's sparse MLA takes any count; FlashMLA's decode keeps its fp8_ds limit in the table
    assert auto.build(auto.compose(90, ALL, "bf16", heads=dsa(16))).capabilities.head_counts == {
        "mla_decode[fp8_ds]": {64, 128}}


def test_head_counts_problem_names_the_op_the_layout_and_the_count():
    fm = fm_backend.CAPABILITIES
    assert backends.head_counts_problem(fm, {"mla_decode": 16}, "bf16") == ""
    assert backends.head_counts_problem(fm, {"mla_decode": 16}, "fp8_ds") == (
        "its mla_decode kernel for layout 'fp8_ds' takes 64 or 128 query heads, got 16")
    assert backends.head_counts_problem(fm, {"mla_decode": 128, "sparse_mla": 24}, "bf16") == (
        "its sparse_mla kernel takes 64 or 128 query heads, got 24")
    assert backends.head_counts_problem(backends.get("triton").capabilities, {"sparse_mla": 24}, "bf16") == ""
    with pytest.raises(TypeError):
        fm.head_counts["sparse_mla"] = frozenset()


def test_flashinfer_prefill_widths_raise_eagerly_and_under_fake_tensors():
    q, k, v = torch.randn(5, 2, 80).to(BF), torch.randn(5, 2, 80).to(BF), torch.randn(5, 2, 16).to(BF)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    assert_value_error(torch.ops.mlagraph_flashinfer.mha_prefill, [q, k, v, cu, cu, 0.1, True],
                       r"flashinfer.mha_prefill: argument 'q': expected \(q, v\) head widths in .*got \(80, 16\)")


def test_auto_composition_table():
    b = auto.build(auto.compose(90, ALL, "bf16"))
    assert b.name == "auto[mla_decode=flashmla,mha_prefill=flashinfer,sparse_mla=flashmla,*=triton]"
    assert b.op_names["mla_decode"] == "mlagraph_flashmla::mla_decode"
    assert b.op_names["mha_prefill"] == "mlagraph_flashinfer::mha_prefill"
    assert b.op_names["rope"] == "mlagraph_triton::rope"
    c = b.capabilities
    assert not c.decode_q_split  # FlashMLA's decode reads q joined
    assert not c.dense_prefill_sdpa  # FlashInfer's ragged prefill
    assert c.page_sizes == {64} and c.preferred_page_size == 64 and c.step_metadata
    assert c.latent_layouts == {"bf16", "fp8_ds"} and c.fused_returns_k
    assert b.owned_ops() == frozenset()  # every op is one of its parts'


def test_auto_on_cpu_is_reference_and_unknown_names_list_auto():
    assert backends.get("auto", "cpu") is backends.get("reference")
    with pytest.raises(ValueError, match="known backends: reference, triton, aiter, flashmla, flashinfer, auto"):
        backends.get("flash")


# ---------------------------------------------------------------------------------------------
# argument errors: the generic ones, and what the libraries cannot take


def _decode_args(dtype=BF, page=64, lat=512, rope=64, heads=4, layout="bf16"):
    width = layouts.latent_row_width(layout, lat, rope)
    store = layouts.latent_storage_dtype(layout, dtype)
    q_nope = torch.randn(2, 1, heads, lat).to(dtype)
    q_pe = torch.randn(2, 1, heads, rope).to(dtype)
    cache = torch.zeros(4, page, width, dtype=store)
    table = torch.tensor([[0, 1], [2, -1]], dtype=torch.int32)
    lens = torch.tensor([70, 3], dtype=torch.int32)
    scale = torch.ones(1) if layout == "fp8" else None
    return [q_nope, q_pe, cache, table, lens, scale, layout, 0.1]


ERRORS = [
    (torch.ops.mlagraph_flashmla.mla_decode, dict(dtype=torch.float32), "flashmla.mla_decode: argument 'q_nope': "
     "expected dtype bfloat16"),
    (torch.ops.mlagraph_flashmla.mla_decode, dict(page=16), r"flashmla.mla_decode: argument 'kv_cache': expected "
     r"pages of 64 tokens"),
    (torch.ops.mlagraph_flashmla.mla_decode, dict(lat=256), "flashmla.mla_decode: argument 'q_nope': expected latent "
     "width 512"),
    (torch.ops.mlagraph_flashmla.mla_decode, dict(layout="fp8"), "flashmla.mla_decode: argument 'layout'"),
    (torch.ops.mlagraph_flashmla.mla_decode, dict(layout="fp8_ds", heads=16), "expected 64 or 128 heads"),
    (torch.ops.mlagraph_flashinfer.mla_decode, dict(dtype=torch.float32), "flashinfer.mla_decode: argument 'q_nope'"),
    (torch.ops.mlagraph_flashinfer.mla_decode, dict(layout="fp8_ds"), "flashinfer.mla_decode: argument 'layout'"),
    (torch.ops.mlagraph_flashinfer.mla_decode, dict(lat=256), "flashinfer.mla_decode: argument 'q_nope': expected "
     "latent width 512 and rope width 64"),
]


@pytest.mark.parametrize("op,kw,match", ERRORS)
def test_library_limits_raise_eagerly_and_under_fake_tensors(op, kw, match):
    assert_value_error(op, _decode_args(**kw), match)


@pytest.mark.parametrize("op", [torch.ops.mlagraph_flashmla.mla_decode, torch.ops.mlagraph_flashinfer.mla_decode])
def test_generic_errors_are_the_generic_ops(op):
    args = _decode_args()
    args[4] = args[4].long()  # seq_lens must be int32
    assert_value_error(op, args, "mlagraph.mla_decode: argument 'seq_lens': expected dtype int32")
    assert_value_error(torch.ops.mlagraph.mla_decode, args, "mlagraph.mla_decode: argument 'seq_lens'")


def test_on_cpu_the_kernels_say_what_hardware_they_need():
    with pytest.raises(ValueError, match="flashmla.mla_decode: its kernels need an NVIDIA GPU of compute capability "
                                         "sm_90, got device cpu"):
        torch.ops.mlagraph_flashmla.mla_decode(*_decode_args())
    q = torch.randn(3, 2, 192, dtype=BF)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="flashinfer.mha_prefill: its kernels need an NVIDIA GPU"):
        torch.ops.mlagraph_flashinfer.mha_prefill(q, q, q[..., :128], cu, cu, 0.1, True)


# ---------------------------------------------------------------------------------------------
# per-step plans (ops/host_plan.py)


def test_plans_are_made_once_per_step_from_the_mirrors():
    dev = torch.tensor([3, 5], dtype=torch.int32)
    host = torch.tensor([3, 5], dtype=torch.int32)
    made = []

    def make(s):
        made.append(host_plan.host_value("t", dev, s))
        return len(made)

    with host_plan.step({dev: host}) as s:
        assert host_plan.host_value("t", dev) is host  # the mirror, not a copy
        assert host_plan.plan("k", make) == 1 and host_plan.plan("k", make) == 1  # every layer: one plan
        assert s.num_plans == 1
    assert host_plan.plan("k", make) == 2 and host_plan.plan("k", make) == 3  # outside a step: fresh each call
    assert torch.equal(host_plan.host_value("t", dev), dev) and host_plan.current() is None  # a copy (here: CPU)
    other = torch.tensor([3, 5], dtype=torch.int32)  # equal values, other tensor: not its mirror
    with host_plan.step({dev: host}):
        assert host_plan.host_value("t", other) is not host


def test_refresh_replans_with_the_new_mirrors():
    dev = torch.tensor([1], dtype=torch.int32)
    seen = []
    s = host_plan.Step({dev: torch.tensor([1], dtype=torch.int32)})
    s.plan("k", lambda st: seen.append(int(host_plan.host_value("t", dev, st))) or "plan",
           lambda value, st: seen.append(int(host_plan.host_value("t", dev, st))))
    s.refresh({dev: torch.tensor([9], dtype=torch.int32)})
    assert seen == [1, 9]


# ---------------------------------------------------------------------------------------------
# device helpers shared by the two backends


def test_effective_lens_cut_at_the_first_missing_page():
    table = torch.tensor([[3, 4, -1], [-1, -1, -1], [0, 1, 2]], dtype=torch.int32)
    lens = torch.tensor([9, 1, 5], dtype=torch.int32)
    assert _paged.effective_lens(table, lens, 4).tolist() == [8, 0, 5]


def test_flat_slots_match_the_block_table():
    table = make_block_table([7, 12], 4, 8)
    pos = torch.tensor([[0, 6, -1, 99], [11, 3, 4, 0]], dtype=torch.int32)
    got = _paged.flat_slots(table, pos, torch.tensor([0, 1], dtype=torch.int32), 4)
    slots = layouts.slots_from_block_table(table, 4, table.shape[1] * 4)
    want = [[int(slots[0, 0]), int(slots[0, 6]), -1, -1], [int(slots[1, p]) for p in (11, 3, 4, 0)]]
    assert got.tolist() == want and got.dtype == torch.int32
    assert _paged.pad_last(got, 64).shape == (2, 64) and (_paged.pad_last(got, 64)[:, 4:] == -1).all()


def test_mask_empty_gives_our_contract():
    out, lse = torch.ones(2, 1, 3, 4), torch.tensor([[[0.5, float("inf"), 1.0]], [[2.0, 2.0, 2.0]]])
    out, lse = _paged.mask_empty(out, lse, torch.tensor([False, True]))
    assert lse[0, 0].tolist() == [0.5, float("-inf"), 1.0] and torch.isneginf(lse[1]).all()
    assert out[1].abs().sum() == 0 and out[0].sum() == 12


def test_flashinfer_csr_metadata():
    table = torch.tensor([[5, 2, 7], [1, -1, -1], [0, -1, -1]], dtype=torch.int32)
    lens = torch.tensor([9, 3, 0], dtype=torch.int32)
    qo, kvp, kvi, kvl = fi_kernels.mla_csr(table, lens, 4, 2)
    assert qo.tolist() == [0, 2, 4, 6] and kvp.tolist() == [0, 3, 4, 4]
    assert kvi.tolist() == [5, 2, 7, 1] and kvl.tolist() == [9, 3, 0]
