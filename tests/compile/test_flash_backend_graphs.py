"""flashmla / flashinfer model graphs on the CPU, with fake twins: each backend registered again
with its own table and op map but no hardware requirement, its library kernels replaced by the
reference op bodies (counted). The passes, the lints (strict) and the op map run as on the
H200; the numbers must equal the reference backend's.

DeepSeek's widths (512 latent + 64 rope) and bf16, as the libraries take; pages of 64.
"""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

import mlagraph
from mlagraph import passes
from mlagraph.model import DeepseekForCausalLM
from mlagraph.model.batch import ForwardMethod, build_batch
from mlagraph.ops import backends, flashinfer as fi_backend, flashmla as fm_backend
from mlagraph.ops._define import op_body
from mlagraph.ops.flashinfer import kernels as fi_kernels
from mlagraph.ops.flashmla import kernels as fm_kernels
from tests.model.conftest import hf_config

PAGE = 64


@pytest.fixture
def fake_twins(monkeypatch):
    """Registers fake_flashmla / fake_flashinfer; yields kernel-call counts."""
    calls = collections.Counter()
    for module, name, ops in ((fm_kernels, "flashmla", ("mla_decode", "sparse_mla")),
                              (fi_kernels, "flashinfer", ("mla_decode", "mha_prefill"))):
        for op in ops:
            body = op_body(f"mlagraph::{op}")

            def counted(*args, _body=body, _key=f"{name}.{op}"):
                calls[_key] += 1
                return _body(*args)

            monkeypatch.setattr(module, op, counted)
    made = []
    for real in (fm_backend.FLASHMLA, fi_backend.FLASHINFER):
        fake = dataclasses.replace(real, name=f"fake_{real.name}", available=True, reason="",
                                   capabilities=dataclasses.replace(real.capabilities, sm=None))
        backends._REGISTRY[fake.name] = fake  # register() would be the same: the op map is the real one
        made.append(fake.name)
    try:
        yield calls
    finally:
        for n in made:
            backends._REGISTRY.pop(n)


def _models(*names):
    # DeepSeek's head widths: the libraries' kernels are built for 576 / 512 and 192 / 128 only
    cfg = hf_config("v3").to_dict() | {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
                                       "v_head_dim": 128, "num_hidden_layers": 2}
    ms = [DeepseekForCausalLM.from_config(cfg, init_std=0.2, backend=n, dtype=torch.bfloat16) for n in names]
    for m in ms[1:]:
        m.load_state_dict(ms[0].state_dict())
    return ms


def _batches(m, kind):
    caps = m.backend.capabilities
    pages = [[0], [1]]

    def mk(tokens, prefix, decode=False):
        return build_batch(caps, tokens, prefix, pages, PAGE, is_decode=[decode] * 2)

    first = mk([[3, 14, 15, 92, 65, 35], [89, 79, 32, 38]], [0, 0])
    if kind == "prefill":
        return [], first
    if kind == "chunked_prefill":
        return [first], mk([[1, 2, 3, 4], [5, 6, 7]], [6, 4])
    if kind == "decode":
        return [first], mk([[7], [8]], [6, 4], decode=True)
    return [first], mk([[7, 8, 9], [10, 11, 12]], [6, 4], decode=True)


def _run(m, kind, compiled: bool, calls: collections.Counter | None = None):
    setup, batch = _batches(m, kind)
    caches = m.allocate_caches(4, PAGE)
    for b in setup:
        with mlagraph.ops.host_plan.step(b.mirrors):
            m(b, caches)
    if calls is not None:
        calls.clear()  # count the batch under test only
    fn = mlagraph.compile(m, backend="mlagraph_eager", fullgraph=True, dynamic=False, strict=True) if compiled else m
    torch._dynamo.reset()
    with mlagraph.ops.host_plan.step(batch.mirrors):
        return batch, fn(batch, caches)


KINDS = ("prefill", "chunked_prefill", "decode", "multi_token_decode")
OWN = {  # kind -> the backend's own kernels the step runs (per layer)
    "fake_flashmla": {"decode": "flashmla.mla_decode", "multi_token_decode": "flashmla.mla_decode"},
    "fake_flashinfer": {"prefill": "flashinfer.mha_prefill", "chunked_prefill": "flashinfer.mha_prefill",
                        "decode": "flashinfer.mla_decode", "multi_token_decode": "flashinfer.mla_decode"},
}


@pytest.mark.parametrize("name", ["fake_flashmla", "fake_flashinfer"])
@pytest.mark.parametrize("kind", KINDS)
def test_graphs_fuse_lint_and_equal_reference(fake_twins, name, kind):
    ref, m = _models("reference", name)
    batch, want = _run(ref, kind, compiled=False)
    batch, got = _run(m, kind, compiled=True, calls=fake_twins)
    report = passes.last_compile()
    assert report.backend == name
    want_method = ForwardMethod.MHA if kind == "prefill" else (
        ForwardMethod.MHA_PREFIX if kind == "chunked_prefill" else ForwardMethod.ABSORBED)
    assert batch.method is want_method
    torch.testing.assert_close(got, want, atol=1e-1, rtol=5e-2)  # bf16 logits, other kernels
    after = report.after
    # regional compilation: both layers run one attention graph, shown once; the twins' call
    # counts below show that each layer runs it
    graphs = after.count("# attention (")
    assert graphs == 1, after
    # the fused front is triton's on both backends: fused once per layer where K feeds only the cache
    if kind != "prefill":
        assert after.count("mlagraph_triton.fused_rope_concat_cache_write(") == graphs
    own = OWN[name].get(kind)
    if own:
        assert fake_twins[own] == 2, dict(fake_twins)  # once per layer
        assert after.count(f"mlagraph_{own}(") == graphs
    else:
        assert not fake_twins
    assert "mlagraph.rope(" not in after and "mlagraph.mla_decode(" not in after


def test_a_step_plans_once_for_every_layer(fake_twins, monkeypatch):
    """FlashInfer's decode plan is made once per step, not once per layer."""
    (m,) = _models("fake_flashinfer")
    plans = []
    real = fi_kernels.mla_decode

    def spy(*args):
        s = mlagraph.ops.host_plan.current()
        key = ("spy", mlagraph.ops.host_plan.tensor_key(args[3]))
        s.plan(key, lambda _s: plans.append(1) or 1)
        return real(*args)

    monkeypatch.setattr(fi_kernels, "mla_decode", spy)
    _run(m, "decode", compiled=False)
    assert plans == [1]


def test_engine_page_size_follows_the_table(fake_twins):
    from mlagraph.model import Engine

    (m,) = _models("fake_flashmla")
    assert Engine(m, max_num_seqs=2, max_model_len=128).page_size == 64
    with pytest.raises(ValueError, match=r"page_size: backend 'fake_flashmla' takes pages of \[64\] tokens, got 16"):
        Engine(m, max_num_seqs=2, max_model_len=128, page_size=16)
    (r,) = _models("reference")
    assert Engine(r, max_num_seqs=2, max_model_len=128).page_size == 16
    assert "backend=fake_flashmla" in repr(m).splitlines()[:2][-1]  # the summary names the backend


def test_golden_decode_graphs(fake_twins):
    """The decode graph on each backend, pinned: triton's fused front on both; FlashMLA reads
    both halves of the fused op's q in place (q joined, decode_q_split=False); FlashInfer reads
    q_nope from the projection and q_pe from the fused op (the concat is eliminated); both run
    triton's moe (a declared fallback)."""
    import expecttest

    tc = expecttest.TestCase()
    graphs = {}
    for name in ("fake_flashmla", "fake_flashinfer"):
        (m,) = _models(name)
        _run(m, "decode", compiled=True)
        graphs[name] = "\n".join(line for line in passes.last_compile().after.splitlines()
                                 if not line.startswith(("v2 ", "v3 ")))
    tc.assertExpectedInline(graphs["fake_flashmla"], """\
# embed
inputs: 2 tensors
# attention (mla): layers 0-1
inputs: 14 tensors
v0 = mlagraph_triton.fused_rope_concat_cache_write(q_nope=_, q_pe=_, kv_c=_, k_pe=_, positions=in7, cos_sin_cache=in8, kv_cache=in9!, slot_mapping=in10, scale=None, layout='bf16', interleaved=True)
v1 = mlagraph_flashmla.mla_decode(q_nope=v0.0~, q_pe=v0.0~, kv_cache=in9', block_table=in11, seq_lens=in12, scale=None, layout='bf16', softmax_scale=0.0935652)
# mlp (dense): layer 0
inputs: 5 tensors
# mlp (moe): layer 1
inputs: 9 tensors
v0 = mlagraph_triton.moe(hidden=_, router_logits=_, gate_up_proj=in3, down_proj=in4, e_score_correction_bias=in5, top_k=2, scoring_func='sigmoid', topk_method='noaux_tc', n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, gate_up_scale=None, down_scale=None, first_expert=None, shared_gate_proj=in6, shared_up_proj=in7, shared_down_proj=in8)
# head
inputs: 4 tensors""")
    tc.assertExpectedInline(graphs["fake_flashinfer"], """\
# embed
inputs: 2 tensors
# attention (mla): layers 0-1
inputs: 14 tensors
v0 = mlagraph_triton.fused_rope_concat_cache_write(q_nope=_, q_pe=_, kv_c=_, k_pe=_, positions=in7, cos_sin_cache=in8, kv_cache=in9!, slot_mapping=in10, scale=None, layout='bf16', interleaved=True)
v1 = mlagraph_flashinfer.mla_decode(q_nope=_, q_pe=v0.0~, kv_cache=in9', block_table=in11, seq_lens=in12, scale=None, layout='bf16', softmax_scale=0.0935652)
# mlp (dense): layer 0
inputs: 5 tensors
# mlp (moe): layer 1
inputs: 9 tensors
v0 = mlagraph_triton.moe(hidden=_, router_logits=_, gate_up_proj=in3, down_proj=in4, e_score_correction_bias=in5, top_k=2, scoring_func='sigmoid', topk_method='noaux_tc', n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, gate_up_scale=None, down_scale=None, first_expert=None, shared_gate_proj=in6, shared_up_proj=in7, shared_down_proj=in8)
# head
inputs: 4 tensors""")


def test_a_model_the_kernels_are_not_built_for_is_refused_or_routed(fake_twins):
    """A toy model (qk 16 + 64, v 16): an explicit FlashInfer backend refuses it at construction,
    naming the op and the widths; ``auto`` composed for it leaves FlashInfer's prefill out."""
    from mlagraph.ops import auto

    cfg = hf_config("v3").to_dict() | {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_hidden_layers": 1}
    with pytest.raises(ValueError, match=r"backend 'fake_flashinfer' cannot run this model: its mha_prefill kernel "
                                         r"is built for .* got \(80, 16\); use backend='auto' or 'triton'"):
        DeepseekForCausalLM.from_config(cfg, backend="fake_flashinfer", dtype=torch.bfloat16)
    installed = {"triton": True, "fake_flashinfer": True, "fake_flashmla": True}
    tables = {n: backends.get(n).capabilities for n in installed}
    dims = {"mha_prefill": (80, 16), "mla_decode": (576, 512)}
    prefs = {"mla_decode": ("fake_flashmla",), "mha_prefill": ("fake_flashinfer",)}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(auto, "PREFERENCE", prefs)
        parts = auto.compose(90, installed, "bf16", tables, dims)
    assert (parts["mla_decode"], parts["mha_prefill"]) == ("fake_flashmla", "triton")


def test_a_head_count_the_sparse_kernels_lack_is_refused_for_the_ops_the_model_runs(fake_twins):
    """4 query heads (a toy; a tensor-parallel shard has 8-32): FlashMLA's dense bf16 decode
    takes them, its sparse kernels (V3.2's sparse MLA, decode over fp8_ds rows) do not."""
    base = hf_config("v3").to_dict() | {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
                                        "v_head_dim": 128, "num_hidden_layers": 1}
    assert base["num_attention_heads"] == 4
    m = DeepseekForCausalLM.from_config(base, backend="fake_flashmla", dtype=torch.bfloat16)
    assert m.backend.name == "fake_flashmla"
    with pytest.raises(ValueError, match=r"backend 'fake_flashmla' cannot run this model: its mla_decode kernel "
                                         r"for layout 'fp8_ds' takes 64 or 128 query heads, got 4"):
        DeepseekForCausalLM.from_config(base, backend="fake_flashmla", dtype=torch.bfloat16, kv_cache_dtype="fp8_ds")
    dsa = hf_config("v32").to_dict() | {k: base[k] for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                                                             "v_head_dim", "num_hidden_layers")} | {"index_head_dim": 128}
    with pytest.raises(ValueError, match=r"cannot run this model: its sparse_mla kernel takes 64 or 128 query "
                                         r"heads, got 4; use backend='auto' or 'triton'"):
        DeepseekForCausalLM.from_config(dsa, backend="fake_flashmla", dtype=torch.bfloat16)
    m = DeepseekForCausalLM.from_config(dsa | {"num_attention_heads": 64}, backend="fake_flashmla",
                                        dtype=torch.bfloat16)
    assert m.backend.name == "fake_flashmla"


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_auto_composition_compiles_and_equals_reference(fake_twins, kind):
    """An ``auto`` composition (FlashMLA decode, FlashInfer prefill, triton elsewhere) is a
    backend of its own to the compiler and the lints, and computes what the reference does."""
    from mlagraph.ops import auto

    parts = {g: "triton" for g in backends.GENERIC_OPS} | {"mla_decode": "fake_flashmla", "mha_prefill": "fake_flashinfer",
                                                          "sparse_mla": "fake_flashmla"}
    composed = auto.build(parts)
    backends._COMPOSED[composed.name] = composed
    try:
        ref, m = _models("reference", composed.name)
        assert m.backend is composed and engine_page_size(m) == 64
        _, want = _run(ref, kind, compiled=False)
        _, got = _run(m, kind, compiled=True, calls=fake_twins)
        torch.testing.assert_close(got, want, atol=1e-1, rtol=5e-2)
        assert passes.last_compile().backend == composed.name
        own = "flashmla.mla_decode" if kind == "decode" else "flashinfer.mha_prefill"
        assert dict(fake_twins) == {own: 2}
    finally:
        backends._COMPOSED.pop(composed.name)


def engine_page_size(model) -> int:
    from mlagraph.model import Engine

    return Engine(model, max_num_seqs=2, max_model_len=128).page_size
