"""Whole-model compile: fullgraph, no recompiles across sizes, equal to eager, no host syncs."""

from __future__ import annotations

import random
import re
import warnings

import pytest
import torch

import mlagraph
from mlagraph.model import DeepseekForCausalLM, Engine
from mlagraph.model.batch import build_batch
from mlagraph.passes import manager
from tests.helpers import NoHostSync
from tests.model.conftest import VOCAB, hf_config, hf_token_logprobs

KINDS = ["v2", "v2_qlora", "v3", "v32"]


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(VOCAB) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("kind", KINDS)
def test_compiled_engine_matches_eager_and_transformers(hf_checkpoint, kind):
    """Inductor + passes: prompt logprobs (whole and chunked) and greedy generation equal the
    eager engine within 1e-4, and the transformers oracle."""
    hf, path = hf_checkpoint(kind)
    model = DeepseekForCausalLM.from_pretrained(path, progress=False)
    mlagraph.passes.clear_reports()  # this test's compiles only (a worker may have compiled an MTP layer before)
    compiled = Engine(model, max_num_seqs=4, max_model_len=128, page_size=4, compile=True)
    eager = Engine(model, max_num_seqs=4, max_model_len=128, page_size=4)
    prompts = _prompts(7, [9, 30, 17])
    for chunk in (None, 7):
        got = compiled.prompt_logprobs(prompts, chunk_size=chunk)
        want = eager.prompt_logprobs(prompts, chunk_size=chunk)
        for ids, g, w in zip(prompts, got, want):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=0)
            torch.testing.assert_close(g, hf_token_logprobs(hf, ids), atol=1e-4, rtol=0)
    a = compiled.generate(prompts, max_new_tokens=5)
    b = eager.generate(prompts, max_new_tokens=5)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4, rtol=0)
    # the passes fired in every layer of every graph that writes the cache
    fused = [r for r in mlagraph.passes.reports() if r.pass_name == "fuse_rope_concat_cache"]
    assert {r.layer for r in fused} == set(range(model.config.num_hidden_layers))


def _one_layer(kind: str = "v3"):
    cfg = hf_config(kind).to_dict()
    cfg["num_hidden_layers"] = 1
    cfg["first_k_dense_replace"] = 0
    return DeepseekForCausalLM.from_config(cfg, init_std=0.2)


def _pages(lens: list[int], page_size: int) -> list[list[int]]:
    out, nxt = [], 0
    for n in lens:
        k = -(-n // page_size)
        out.append(list(range(nxt, nxt + k)))
        nxt += k
    return out


def test_no_recompiles_across_batch_sizes_and_prompt_lengths():
    """One graph per plan variant (prefill, chunked prefill, decode) over batch sizes 1..64 and
    prompt lengths 1..200: dynamic token/request dims, one request included (not padded, as
    the engine runs it: sizes are traced size-oblivious)."""
    model = _one_layer()
    caps, ps = model.backend.capabilities, 4
    caches = model.allocate_caches(64 * 60, ps)
    compiled = mlagraph.compile(model, backend="mlagraph_eager", fullgraph=True, dynamic=True)
    torch._dynamo.reset()
    before = len(manager._REPORTS)
    rnd = random.Random(0)

    def run(tokens, prefix, is_decode):
        lens = [p + len(t) for p, t in zip(prefix, tokens)]
        batch = build_batch(caps, tokens, prefix, _pages(lens, ps), ps, is_decode=is_decode)
        compiled(batch, caches)

    for n in range(1, 201):  # prompt lengths 1..200
        run([[1] * n], [0], [False])
    for b in range(1, 65):  # batch sizes 1..64: prefill, then decode over random contexts
        run([[1] * rnd.randint(1, 12) for _ in range(b)], [0] * b, [False] * b)
        run([[2] for _ in range(b)], [rnd.randint(1, 199) for _ in range(b)], [True] * b)
    for b in (1, 5, 33):  # chunked prefill over a cached prefix
        run([[3] * rnd.randint(1, 20) for _ in range(b)], [rnd.randint(1, 150) for _ in range(b)], [False] * b)
    graphs = manager._REPORTS[before:]
    assert len(graphs) == 3, [g.graph for g in graphs]
    # regional: each region (embed, head, the MoE, attention per variant) compiled once, never again
    assert set(compiled.graphs.values()) == {1} and compiled.num_graphs == 3 + 3, compiled.graphs


@pytest.mark.parametrize("kind", ["v3", "v32"])
@pytest.mark.parametrize("s_q", [1, 3])
def test_decode_step_has_no_host_sync(kind, s_q):
    """The decode step reads no device value on the host — inside the custom ops too."""
    model = DeepseekForCausalLM.from_config(hf_config(kind), init_std=0.2)
    caps, ps = model.backend.capabilities, 4
    caches = model.allocate_caches(64, ps)
    prefix = [5, 9]
    tokens = [[7] * s_q, [3] * s_q]
    batch = build_batch(caps, tokens, prefix, _pages([p + s_q for p in prefix], ps), ps,
                        is_decode=[True, True], dsa=model.config.uses_dsa)
    mode = NoHostSync()
    with mode:
        model(batch, caches)
    assert "mlagraph::mla_decode" in mode.ops_seen or "mlagraph::sparse_mla" in mode.ops_seen


def test_no_host_sync_mode_catches_syncs():
    """The checker itself has teeth: .item(), bool(), nonzero and boolean masks fail under it.
    (``.tolist()`` on a CPU tensor reads memory without dispatching any op; on CPU it cannot be
    seen, and the model code has none.)"""
    x = torch.tensor([1.0, 0.0])
    for bad in (lambda: x.sum().item(), lambda: bool(x.sum()), lambda: x.nonzero(), lambda: x[x > 0]):
        with pytest.raises(AssertionError, match="host sync"):
            with NoHostSync():
                bad()


def test_compile_fullgraph_and_warns_when_fusion_cannot_match():
    """fullgraph=True compiles prefill and decode with no graph break; and a requested fusion
    that matches nowhere warns (a model whose RoPE op was swapped for an opaque function)."""
    model = _one_layer()
    caps = model.backend.capabilities
    caches = model.allocate_caches(16, 4)
    compiled = mlagraph.compile(model, backend="mlagraph_eager", fullgraph=True, dynamic=True)
    compiled(build_batch(caps, [[1, 2, 3]], [0], [[0]], 4, min_reqs=2), caches)
    compiled(build_batch(caps, [[4], [5]], [3, 3], [[0], [1]], 4, is_decode=[True, True]), caches)
    assert [r.pass_name for r in mlagraph.passes.last_report()] == ["fuse_rope_concat_cache", "eliminate_concat"]

    def no_fusable_sequence(kv_c, k_pe, cache, slots):
        torch.ops.mlagraph.latent_cache_write(kv_c, k_pe, cache, slots, None, "bf16")  # unrotated k_pe
        return kv_c + 1

    fn = mlagraph.compile(no_fusable_sequence, backend="mlagraph_eager", attention_backend="reference", lint=False)
    args = (torch.randn(3, 32), torch.randn(3, 8), torch.zeros(4, 4, 40), torch.tensor([0, 1, 2]))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fn(*args)
    assert any("matched in no layer" in str(w.message) for w in seen)


def test_decode_reads_the_absorbed_q_in_place():
    """eliminate_concat hands the decode op q's two halves without the cat; Inductor must not
    copy them back into a cat-shaped buffer because the traced graph had one (the op's recorded
    eager input layout): no kernel of Inductor's code is a copy made for mla_decode, and the
    compiled step equals eager."""
    from torch._inductor.utils import run_and_get_code

    model = _one_layer()
    caps = model.backend.capabilities
    caches = model.allocate_caches(16, 4)
    prefill = build_batch(caps, [[1, 2, 3], [4, 5]], [0, 0], [[0], [1]], 4)
    decode = build_batch(caps, [[6], [7]], [3, 2], [[0], [1]], 4, is_decode=[True, True])
    with torch.no_grad():
        model(prefill, caches)
        eager = model(decode, caches)  # writes the decode tokens' rows; the compiled step rewrites the same
        torch._dynamo.reset()
        compiled = mlagraph.compile(model, backend="mlagraph", fullgraph=True, regional=False)
        out, codes = run_and_get_code(compiled, decode, caches)
    assert [r.pass_name for r in mlagraph.passes.last_report()] == ["fuse_rope_concat_cache", "eliminate_concat"]
    code = "\n".join(codes)
    assert "mla_decode.default(" in code
    copies = sorted(set(re.findall(r"\b(\w*fused\w*mla_decode\w*)\(", code)))
    assert not copies, f"Inductor copies mla_decode's inputs: {copies}"
    torch.testing.assert_close(out, eager, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", ["dense", "split"])
def test_dsa_dense_and_split_variants_compile_and_match_eager(variant):
    """The DSA plan variants compile whole (fullgraph, strict: fusion in every layer, lints
    pass) and give eager's logits and caches."""
    model = DeepseekForCausalLM.from_config(hf_config("v32"), init_std=0.2)
    caps, ps = model.backend.capabilities, 4
    lens = [5, 9] if variant == "dense" else [5, 30]
    pages = _pages(lens, ps)
    batch = build_batch(caps, [[1 + i % 7 for i in range(n)] for n in lens], [0, 0], pages, ps, dsa=True,
                        dsa_dense_max_kv_len=model.config.index_topk)
    assert batch.plan.dsa_dense is (variant == "dense") and batch.plan.dsa_split is (variant == "split")
    eager_caches, compiled_caches = model.allocate_caches(16, ps), model.allocate_caches(16, ps)
    want = model(batch, eager_caches)
    compiled = mlagraph.compile(model, backend="mlagraph_eager", fullgraph=True, dynamic=True, strict=True)
    got = compiled(batch, compiled_caches)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    for a, b in zip(eager_caches.latent + eager_caches.index, compiled_caches.latent + compiled_caches.index):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    fused = {r.layer for r in mlagraph.passes.last_report() if r.pass_name == "fuse_rope_concat_cache"}
    assert fused == set(range(model.config.num_hidden_layers))


def test_dsa_variants_do_not_recompile_across_sizes():
    """V3.2: one graph per plan variant (dense prefill, sparse prefill, split prefill, dense
    decode, sparse decode, split decode) whatever the batch and group sizes, 1 included."""
    cfg = hf_config("v32").to_dict()
    cfg["num_hidden_layers"] = 1
    cfg["first_k_dense_replace"] = 1
    model = DeepseekForCausalLM.from_config(cfg, init_std=0.2)
    caps, ps, topk = model.backend.capabilities, 4, model.config.index_topk
    caches = model.allocate_caches(256, ps)
    compiled = mlagraph.compile(model, backend="mlagraph_eager", fullgraph=True, dynamic=True)
    before = len(manager._REPORTS)
    rnd = random.Random(1)
    variants = set()

    def run(lens, decode):
        prefix = [n - 1 if decode else 0 for n in lens]
        tokens = [[1] if decode else [1] * n for n in lens]
        batch = build_batch(caps, tokens, prefix, _pages(lens, ps), ps, is_decode=[decode] * len(lens),
                            dsa=True, dsa_dense_max_kv_len=topk, min_reqs=2)
        variants.add((batch.plan.kind, batch.method))
        compiled(batch, caches)

    for decode in (False, True):
        for short, long in [(1, 0), (3, 0), (0, 1), (0, 4), (1, 1), (1, 3), (4, 1), (2, 2), (5, 3)]:
            lens = [rnd.randint(2, topk) for _ in range(short)] + [rnd.randint(topk + 1, 40) for _ in range(long)]
            run(lens, decode)
    graphs = manager._REPORTS[before:]
    assert len(variants) == 6 and len(graphs) == 6, (sorted(str(v) for v in variants), [g.graph for g in graphs])
    assert set(compiled.graphs.values()) == {1}, compiled.graphs  # no region recompiled
