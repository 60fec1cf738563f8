"""MTP speculative decoding (Engine(speculative="mtp")): exact greedy outputs, rollback of
rejected cache rows, page accounting, the prefix cache's lookahead key, the CUDA-graph path
(static buffers, run on CPU), arguments.

Random tiny DeepSeeks with an MTP layer (float32, reference backend): with random weights
the MTP layer's drafts are almost always rejected, so these runs exercise rejection; the
"oracle" draft hook (drafts = the main model's own greedy tokens) exercises acceptance.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from mlagraph.engine import cuda_graphs as graphs
from mlagraph.engine import speculative
from mlagraph.model import DeepseekForCausalLM, Engine
from mlagraph.model.batch import ForwardMethod

from tests.compile.fake_backend import registered_backend
from tests.model.conftest import VOCAB, hf_config

MAX_LEN = 48


def mtp_config(kind: str) -> dict:
    """conftest's config with one MTP layer (transformers' V3.2 config has no such key)."""
    return {**hf_config(kind).to_dict(), "num_nextn_predict_layers": 1}


@pytest.fixture(scope="module")
def models():
    made = {}

    def get(kind: str, backend: str = "reference"):
        if (kind, backend) not in made:
            made[kind, backend] = DeepseekForCausalLM.from_config(mtp_config(kind), backend=backend)
        return made[kind, backend]

    return get


def _engine(model, **kw) -> Engine:
    kw.setdefault("max_num_seqs", 4)
    kw.setdefault("max_model_len", MAX_LEN)
    kw.setdefault("page_size", 4)
    return Engine(model, **kw)


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(VOCAB) for _ in range(n)] for n in lengths]


def _assert_same(got, want, atol: float = 1e-4):
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert g.finish_reason == w.finish_reason and g.stop_reason == w.stop_reason
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=atol, rtol=0)


def _oracle_hook(want: dict[tuple, list[int]], k: int):
    """Drafts = the main model's greedy continuation of the request (keyed by prompt)."""

    def hook(req, drafts):
        cont = want[tuple(req.tokens[: req.prompt_len])]
        n = req.num_generated
        return (cont[n : n + k] + [0] * k)[:k]

    return hook


# --- exact greedy outputs ------------------------------------------------------------------------


@pytest.mark.parametrize("kind, k, chunk, prefix", [
    ("v3", 1, None, False),
    ("v3", 3, 5, True),  # chunked prefill; 5 prompts, 4 at a time: mixed steps
    ("v32", 2, 5, False),  # V3.2: 14 + 8 > index_topk = 12, so sparse verify steps too
    ("v32", 3, None, True),
])
def test_greedy_equals_no_speculation(models, kind, k, chunk, prefix):
    model = models(kind)
    prompts = _prompts(3, [3, 14, 9, 6, 11])
    prompts[3] = prompts[1][:8] + prompts[3]  # shares two pages with prompt 1
    want = _engine(model, prefill_chunk_size=chunk).generate(prompts, max_new_tokens=8, ignore_eos=True)
    engine = _engine(model, prefill_chunk_size=chunk, prefix_caching=prefix, speculative="mtp",
                     num_speculative_tokens=k)
    got = engine.generate(prompts, max_new_tokens=8, ignore_eos=True)
    _assert_same(got, want)
    s = engine.stats
    assert s.drafted_tokens > s.accepted_tokens >= 0  # random weights: rejections happened
    assert s.acceptance_rate == s.accepted_tokens / s.drafted_tokens
    assert engine.allocator.num_free == engine.num_pages
    if prefix:  # again, from the prefix cache: still exact
        again = engine.generate(prompts, max_new_tokens=8, ignore_eos=True)
        assert engine.stats.cached_prompt_tokens > 0
        _assert_same(again, want)


@pytest.mark.parametrize("k", [1, 3])
def test_oracle_drafts_are_all_accepted(models, k):
    """Drafts equal to the target's own tokens are all kept: k + 1 tokens per decode step."""
    model = models("v3")
    prompts = _prompts(4, [5, 9])
    n = 9
    long = _engine(model).generate(prompts, max_new_tokens=n + k, ignore_eos=True)
    want = {tuple(p): o.token_ids for p, o in zip(prompts, long)}
    engine = _engine(model, speculative="mtp", num_speculative_tokens=k)
    engine.speculator.draft_hook = _oracle_hook(want, k)
    got = engine.generate(prompts, max_new_tokens=n, ignore_eos=True)
    assert [g.token_ids for g in got] == [w.token_ids[:n] for w in long]
    s = engine.stats
    assert s.accepted_tokens == s.drafted_tokens > 0 and s.acceptance_rate == 1.0
    # one prefill step, then each decode step emits k + 1 tokens (the last may be cut by the length)
    assert s.steps == 1 + math.ceil((n - 1) / (k + 1))


def test_stop_token_inside_an_accepted_run(models):
    """A stop token (or the length) in the middle of k accepted drafts ends the request there."""
    model = models("v3")
    k = 3
    prompt = _prompts(7, [6])
    long = _engine(model).generate(prompt, max_new_tokens=12, ignore_eos=True)[0].token_ids
    stop = next(t for i, t in enumerate(long) if i >= 2 and t not in long[:i])  # first seen at index >= 2
    want = _engine(model).generate(prompt, max_new_tokens=12, stop_token_ids=[stop], ignore_eos=True)
    engine = _engine(model, speculative="mtp", num_speculative_tokens=k)
    engine.speculator.draft_hook = _oracle_hook({tuple(prompt[0]): long}, k)
    got = engine.generate(prompt, max_new_tokens=12, stop_token_ids=[stop], ignore_eos=True)
    _assert_same(got, want)
    assert got[0].finish_reason == "stop" and got[0].token_ids[-1] == stop
    got = engine.generate(prompt, max_new_tokens=6, ignore_eos=True)  # 1 + 4 + 1 of 4
    assert got[0].token_ids == long[:6] and got[0].finish_reason == "length"


def test_sampling_runs_and_stays_in_vocabulary(models):
    """temperature > 0 end to end (the distribution itself: tests/engine/test_spec_sampling.py)."""
    engine = _engine(models("v3"), speculative="mtp", num_speculative_tokens=2, seed=3)
    got = engine.generate(_prompts(8, [4, 7]), max_new_tokens=6, temperature=0.8, ignore_eos=True)
    assert all(len(g.token_ids) == 6 and all(0 <= t < VOCAB for t in g.token_ids) for g in got)
    assert all(math.isfinite(lp) and lp <= 0 for g in got for lp in g.logprobs)


# --- rollback: rejected rows are rewritten before anything reads them ----------------------------


def _rows(layer_tensors, pages, n, ps):
    """Each layer's cache rows at positions 0..n-1 of a request on ``pages``."""
    return [t[[pages[p // ps] for p in range(n)], [p % ps for p in range(n)]] for t in layer_tensors]


@pytest.mark.parametrize("kind", ["v3", "v32"])
def test_cache_rows_after_rejections_are_the_accepted_tokens(models, kind):
    """After steps with rejected drafts, every valid cache row (latent, and V3.2's indexer
    keys) equals the row a plain prefill of the accepted tokens writes: the rows of rejected
    drafts were overwritten. Pages hold exactly what the next verify step writes."""
    model, k, ps = models(kind), 3, 4
    engine = _engine(model, speculative="mtp", num_speculative_tokens=k)
    engine.add_request(_prompts(9, [7])[0], max_new_tokens=30, ignore_eos=True)
    for _ in range(6):
        engine.step()
        (req,) = engine.scheduler.running
        assert len(req.pages) == math.ceil((req.num_cached + k + 1) / ps)
    assert engine.stats.drafted_tokens > engine.stats.accepted_tokens
    n = req.num_cached
    plain = _engine(model)
    plain.add_request(req.tokens[: n + 1], max_new_tokens=1)
    plain.runner.run(plain.scheduler.schedule(), all_logits=False)  # a prefill writes rows 0..n
    (fresh,) = plain.scheduler.running
    L = model.config.num_hidden_layers
    for name in ("latent", "index") if kind == "v32" else ("latent",):
        got = _rows(getattr(engine.speculator.caches, name)[:L], req.pages, n, ps)
        want = _rows(getattr(plain.caches, name), fresh.pages, n, ps)
        for layer, (g, w) in enumerate(zip(got, want)):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, msg=f"{name} layer {layer}")
    engine.abort_all()


def test_prefix_cache_key_covers_the_next_token():
    """With lookahead=1 two prompts share a page only if they agree one token past it."""
    from mlagraph.engine.block_manager import BlockManager

    for lookahead, shared in ((0, True), (1, False)):
        bm = BlockManager(8, 4, prefix_caching=True, lookahead=lookahead)
        a = [1, 2, 3, 4, 5, 6]
        pages = bm.allocate(2)
        hashes = []
        bm.cache_full_pages(pages, a, 6, hashes)
        bm.free(pages)
        got, _ = bm.match_prefix([1, 2, 3, 4, 9, 9], max_pages=1)
        assert bool(got) is shared
        got, _ = bm.match_prefix([1, 2, 3, 4, 5, 7], max_pages=1)
        assert got == pages[:1]
    bm = BlockManager(8, 4, prefix_caching=True, lookahead=1)
    hashes = []
    bm.cache_full_pages(bm.allocate(1), [1, 2, 3, 4], 4, hashes)
    assert hashes == []  # the token after the page is not known yet


# --- backends without multi-token decode, the graph path, compile --------------------------------


def test_backend_without_multi_token_decode_verifies_through_mha_over_the_prefix(models):
    """A backend whose decode takes s_q = 1 only (aiter) verifies with MHA over the prefix."""
    with registered_backend("s_q_one", multi_token_decode=False):
        model = DeepseekForCausalLM.from_config(mtp_config("v3"), backend="s_q_one")
        prompts = _prompts(10, [5, 8])
        want = _engine(model).generate(prompts, max_new_tokens=6, ignore_eos=True)
        engine = _engine(model, speculative="mtp", num_speculative_tokens=2)
        seen = []
        fn = engine.speculator.hidden_fn
        engine.speculator.hidden_fn = lambda b, c: (seen.append((b.plan.kind.value, b.method)), fn(b, c))[1]
        _assert_same(engine.generate(prompts, max_new_tokens=6, ignore_eos=True), want)
        assert ("multi_token_decode", ForwardMethod.MHA_PREFIX) in seen


class _DirectGraphs(graphs.DecodeGraphs):
    """DecodeGraphs whose "graphs" call the step on the static batch (tests/engine/test_cuda_graphs.py)."""

    def _setup(self):
        self.batches, self.replays = {}, []

    def _capture(self, bucket, method, batch):
        self.batches[(bucket, method)] = batch

    def _replay(self, bucket, method):
        self.replays.append((bucket, method))
        with torch.no_grad():
            return self._fn(self.batches[(bucket, method)], self._caches)


@pytest.mark.parametrize("kind", ["v3", "v32"])
def test_graph_path_equals_plain_engine_cpu(models, kind, monkeypatch):
    """Verify, catch-up and chain steps through the static buffers of their buckets."""
    model = models(kind)
    prompts = _prompts(11, [3, 9, 14, 5, 2])
    want = _engine(model).generate(prompts, max_new_tokens=7, ignore_eos=True)
    engine = _engine(model, speculative="mtp", num_speculative_tokens=2)
    monkeypatch.setattr(speculative.graphs, "DecodeGraphs", _DirectGraphs)
    engine.speculator._capture([1, 2, 4], progress=False)
    _assert_same(engine.generate(prompts, max_new_tokens=7, ignore_eos=True), want)
    sp = engine.speculator
    for g in (sp.verify_graphs, sp.catchup_graphs, sp.chain_graphs):
        assert {b for b, _ in g.replays} >= {4}
    if kind == "v32":
        assert {m for _, m in sp.verify_graphs.replays} == {ForwardMethod.ABSORBED, ForwardMethod.SPARSE}


def test_static_multi_token_inputs_equal_build_batch():
    from mlagraph.model.batch import build_batch

    caps, ps, q = DeepseekForCausalLM.from_config(mtp_config("v3")).backend.capabilities, 4, 3
    inputs = graphs.StaticDecodeInputs(4, 5, "cpu", q_len=q)
    reqs = [([5, 6, 7], 6, [3, 1, 6]), ([8, 9, 1], 9, [0, 2, 4])]  # tokens, prefix, pages
    tokens, positions, slots = [], [], []
    for toks, start, pages in reqs:
        tokens += toks
        positions += range(start, start + q)
        slots += [pages[p // ps] * ps + p % ps for p in range(start, start + q)]
    inputs.fill(tokens, positions, slots, [r[2] for r in reqs], [r[1] + q for r in reqs], bucket=4)
    plan = graphs.decode_plans(caps, False, q)[ForwardMethod.ABSORBED]
    static = inputs.batch(4, ForwardMethod.ABSORBED, plan)
    ref = build_batch(caps, [r[0] for r in reqs], [r[1] for r in reqs], [r[2] for r in reqs], ps,
                      is_decode=[True, True], all_logits=True, min_reqs=4)
    assert static.plan == ref.plan
    for name in ("input_ids", "positions", "slot_mapping", "req_ids", "seq_lens", "cu_seqlens_q", "cu_seqlens_k",
                 "logits_indices"):
        assert torch.equal(getattr(static, name).long(), getattr(ref, name).long()), name
    assert torch.equal(static.block_table[:, :3], ref.block_table[:, :3])
    with pytest.raises(ValueError, match=r"expected 6 tokens, positions and slots \(3 per request\), got 5"):
        inputs.fill(tokens[:5], positions, slots, [r[2] for r in reqs], [9, 12], bucket=4)


def test_compiled_speculation_equals_no_speculation(models):
    model = models("v3")
    prompts = _prompts(12, [4, 7])
    want = _engine(model).generate(prompts, max_new_tokens=5, ignore_eos=True)
    engine = _engine(model, speculative="mtp", num_speculative_tokens=2, compile=True,
                     compile_backend="mlagraph_eager")
    _assert_same(engine.generate(prompts, max_new_tokens=5, ignore_eos=True), want)
    assert engine.compiled_graphs > 0


def test_compiled_speculation_shares_the_layer_graphs_and_stays_flat_in_depth():
    """The verify and hidden-state steps are the engine's regional step with other heads: the
    same embedding, attention and MLP graphs (compiled once), and as many graphs at 4 layers as
    at 2."""
    from mlagraph.regional import RegionalStep

    prompts = _prompts(13, [5, 9])
    counts = {}
    for layers in (2, 4):
        model = DeepseekForCausalLM.from_config({**mtp_config("v3"), "num_hidden_layers": layers})
        want = _engine(model).generate(prompts, max_new_tokens=4, ignore_eos=True)
        engine = _engine(model, speculative="mtp", num_speculative_tokens=2, compile=True,
                         compile_backend="mlagraph_eager")
        _assert_same(engine.generate(prompts, max_new_tokens=4, ignore_eos=True), want)
        spec, step = engine.speculator, engine.runner.step_fn
        assert isinstance(spec.target_fn, RegionalStep) and spec.target_fn.regions is step.regions
        assert spec.hidden_fn.regions is step.regions
        heads = sorted(k for k in step.regions if k[0] == "head")
        # without CUDA graphs every step reads the hidden states (logits taken from them); the
        # target head serves the captured verify steps
        assert heads == [("head", "hidden_head")]
        assert all(r.graphs == 1 for r in step.regions.values())  # nothing compiled twice
        counts[layers] = engine.compiled_graphs
    assert counts[2] == counts[4] > 0


# --- arguments -----------------------------------------------------------------------------------


def test_speculative_arguments_are_checked(models):
    with_mtp = models("v3")
    without = DeepseekForCausalLM.from_config(hf_config("v2"))
    assert without.mtp is None
    cases = [
        (without, dict(speculative="mtp"), r"speculative='mtp': expected a model with an MTP layer"),
        (with_mtp, dict(speculative="eagle"), r"speculative: expected None or 'mtp', got 'eagle'"),
        (with_mtp, dict(speculative="mtp", num_speculative_tokens=4), r"num_speculative_tokens: expected an int in 1..3, got 4"),
        (with_mtp, dict(speculative="mtp", num_speculative_tokens=0), r"expected an int in 1..3, got 0"),
        (with_mtp, dict(num_speculative_tokens=2), r"num_speculative_tokens: given \(2\) but speculative=None"),
        (with_mtp, dict(speculative="mtp", num_speculative_tokens=3, max_model_len=255),
         r"max_model_len: expected <= max_position_embeddings - num_speculative_tokens \(256 - 3"),
        (with_mtp, dict(speculative="mtp", num_speculative_tokens=2, num_pages=12),
         r"num_pages: expected at least 13 .* 2 speculative slots"),
    ]
    for model, kw, match in cases:
        with pytest.raises(ValueError, match=match):
            _engine(model, **kw)


# --- GPU -------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["v3", "v32"])
@pytest.mark.parametrize("k", [1, 3])
def test_gpu_graphed_speculation_equals_no_speculation(kind, k):
    """Verify, catch-up and chain steps replayed from real CUDA graphs (triton backend)."""
    model = DeepseekForCausalLM.from_config(mtp_config(kind), backend="triton", device="cuda")
    prompts = _prompts(13, [3, 9, 14, 5, 2])
    want = _engine(model, cuda_graphs=True).generate(prompts, max_new_tokens=10, ignore_eos=True)
    engine = _engine(model, cuda_graphs=True, speculative="mtp", num_speculative_tokens=k)
    # float32 on the H200: logprobs within the GPU suite's tolerance (the s_q = k + 1 kernel sums in another order)
    _assert_same(engine.generate(prompts, max_new_tokens=10, ignore_eos=True), want, atol=1e-2)
    assert engine.graphs is engine.speculator.verify_graphs and engine.stats.drafted_tokens > 0
