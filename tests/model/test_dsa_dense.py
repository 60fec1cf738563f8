"""DSA (V3.2) dense variant: a batch whose every kv length fits in index_topk runs dense MHA /
absorbed attention (top-k would keep every key, so this is exact) and still writes the indexer
keys that later sparse steps read."""

from __future__ import annotations

import random

import pytest
import torch

from mlagraph.model import DeepseekForCausalLM, Engine, ForwardMethod
from mlagraph.model.batch import build_batch, plan_batch

from .conftest import VOCAB, hf_token_logprobs

TOPK = 12  # conftest's V3.2 index_topk


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(VOCAB) for _ in range(n)] for n in lengths]


def _engine(path, **kw) -> Engine:
    model = DeepseekForCausalLM.from_pretrained(path, progress=False)
    return Engine(model, max_num_seqs=4, max_model_len=64, page_size=4, **kw)


class _Spy:
    """Counts, per layer-step, the indexer's scoring of whole batches (sparse), key-only writes
    (dense or split steps) and scoring of a split step's sparse tokens (``selected``, with the
    number of tokens scored)."""

    def __init__(self, model):
        self.scored = self.keys_only = self.selected = self.selected_tokens = 0
        for layer in model.model.layers:
            idx = layer.self_attn.indexer
            idx.register_forward_hook(lambda *a: setattr(self, "scored", self.scored + 1))
            write_keys, select = idx.write_keys, idx.select

            def counted_write_keys(*args, _orig=write_keys, **kw):
                self.keys_only += 1
                return _orig(*args, **kw)

            def counted_select(x, *args, _orig=select, **kw):
                self.selected += 1
                self.selected_tokens += x.shape[0]
                return _orig(x, *args, **kw)

            idx.write_keys, idx.select = counted_write_keys, counted_select


@pytest.mark.parametrize(
    "kv_lens, limit, dense",
    [([5, 12], 12, True), ([5, 13], 12, False), ([12], 0, False), ([40], 64, True)],
)
def test_plan_is_dense_iff_every_kv_length_fits(kv_lens, limit, dense):
    plan = plan_batch(kv_lens, [0] * len(kv_lens), [False] * len(kv_lens), dsa=True, dsa_dense_max_kv_len=limit)
    assert plan.dsa_dense is dense


def test_dense_methods_for_each_batch_kind(hf_checkpoint):
    _, path = hf_checkpoint("v32")
    model = DeepseekForCausalLM.from_pretrained(path, progress=False)
    caps = model.backend.capabilities
    cases = [
        (dict(token_ids=[[1, 2, 3]], prefix_lens=[0], pages=[[0]]), ForwardMethod.MHA),
        (dict(token_ids=[[1, 2]], prefix_lens=[5], pages=[[0, 1]]), ForwardMethod.MHA_PREFIX),
        (dict(token_ids=[[1]], prefix_lens=[5], pages=[[0, 1]], is_decode=[True]), ForwardMethod.ABSORBED),
        (dict(token_ids=[[1]], prefix_lens=[12], pages=[[0, 1, 2, 3]], is_decode=[True]), ForwardMethod.SPARSE),
    ]
    for kw, method in cases:
        batch = build_batch(caps, page_size=4, dsa=True, dsa_dense_max_kv_len=TOPK, **kw)
        assert batch.method is method


@pytest.mark.parametrize("chunk_size", [None, 5])
def test_planner_equals_forced_sparse_up_to_index_topk(hf_checkpoint, chunk_size):
    """Exactness: prompts of length <= index_topk give the same logprobs dense and sparse, and
    both equal transformers' DeepseekV32."""
    hf, path = hf_checkpoint("v32")
    prompts = _prompts(11, [TOPK, 7, 3])
    planned = _engine(path)
    spy = _Spy(planned.model)
    got = planned.prompt_logprobs(prompts, chunk_size=chunk_size)
    assert spy.keys_only > 0 and spy.scored == 0  # really dense
    forced = _engine(path, dsa_dense_max_kv_len=0).prompt_logprobs(prompts, chunk_size=chunk_size)
    for ids, a, b in zip(prompts, got, forced):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
        torch.testing.assert_close(a, hf_token_logprobs(hf, ids), atol=1e-4, rtol=0)


def test_sparse_decode_after_dense_prefill_matches_transformers(hf_checkpoint):
    """A dense prefill must still fill the indexer-key cache: decoding past index_topk (sparse)
    then scores those keys. Every generated token's logprob equals transformers' teacher-forced
    one."""
    hf, path = hf_checkpoint("v32")
    engine = _engine(path)
    spy = _Spy(engine.model)
    prompt = _prompts(12, [9])[0]
    out = engine.generate([prompt], max_new_tokens=12)[0]
    assert spy.keys_only > 0 and spy.scored > 0  # dense steps, then sparse ones
    full = prompt + out.token_ids
    want = hf_token_logprobs(hf, full)[len(prompt) - 1 :]
    torch.testing.assert_close(torch.tensor(out.logprobs), want, atol=1e-4, rtol=0)


def test_dense_prefill_writes_the_same_indexer_keys_as_sparse(hf_checkpoint):
    _, path = hf_checkpoint("v32")
    prompts = _prompts(13, [10, 6])
    dense, sparse = _engine(path), _engine(path, dsa_dense_max_kv_len=0)
    # one prefill step (+1 sampled token) each; fresh engines allocate the same pages
    outs = [e.generate(prompts, max_new_tokens=1) for e in (dense, sparse)]
    assert outs[0][0].token_ids == outs[1][0].token_ids
    # layer 0 sees identical inputs: bit-identical keys; later layers' inputs went through
    # dense vs sparse attention, equal up to float rounding
    torch.testing.assert_close(dense.caches.index[0], sparse.caches.index[0], atol=0, rtol=0)
    assert dense.caches.index[0].abs().sum() > 0
    for a, b in zip(dense.caches.index[1:], sparse.caches.index[1:]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_engine_rejects_bad_dense_limit(hf_checkpoint):
    _, path = hf_checkpoint("v32")
    with pytest.raises(ValueError, match="dsa_dense_max_kv_len"):
        _engine(path, dsa_dense_max_kv_len=-1)


@pytest.mark.parametrize("chunk_size", [None, 6])
def test_mixed_batch_splits_dense_and_sparse_requests(hf_checkpoint, chunk_size):
    """One batch, short and long prompts: the short ones run dense, only the long one's tokens
    are scored by the indexer, and every logprob equals transformers' and the forced-sparse run."""
    hf, path = hf_checkpoint("v32")
    prompts = _prompts(14, [5, 30, 9])  # 5, 9 <= index_topk < 30
    engine = _engine(path)
    spy = _Spy(engine.model)
    got = engine.prompt_logprobs(prompts, chunk_size=chunk_size)
    assert spy.selected > 0  # at least one split step
    if chunk_size is None:  # one split step: only the long prompt's 30 tokens were scored, per layer
        assert spy.scored == 0
        assert spy.selected_tokens == 30 * engine.model.config.num_hidden_layers
    forced = _engine(path, dsa_dense_max_kv_len=0).prompt_logprobs(prompts, chunk_size=chunk_size)
    for ids, a, b in zip(prompts, got, forced):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
        torch.testing.assert_close(a, hf_token_logprobs(hf, ids), atol=1e-4, rtol=0)


def test_split_method_for_mixed_kv_lengths(hf_checkpoint):
    _, path = hf_checkpoint("v32")
    model = DeepseekForCausalLM.from_pretrained(path, progress=False)
    batch = build_batch(model.backend.capabilities, [[1] * 3, [1] * 20], [0, 0], [[0], [1, 2, 3, 4, 5]], 4,
                        dsa=True, dsa_dense_max_kv_len=TOPK)
    assert batch.method is ForwardMethod.DSA_SPLIT
    assert batch.split.dense_rows.tolist() == [0, 1, 2]
    assert batch.split.sparse_rows.tolist() == list(range(3, 23))
    assert batch.split.dense_block_table.tolist() == [[0, -1, -1, -1, -1]]
    assert batch.split.dense_cu_seqlens_k.tolist() == [0, 3] and batch.split.dense_num_kv_tokens == 3


def test_generation_with_mixed_batches_equals_alone(hf_checkpoint):
    _, path = hf_checkpoint("v32")
    prompts = _prompts(15, [4, 25, 10])
    together = _engine(path).generate(prompts, max_new_tokens=6)
    for p, t in zip(prompts, together):
        alone = _engine(path).generate([p], max_new_tokens=6)[0]
        assert alone.token_ids == t.token_ids
        torch.testing.assert_close(torch.tensor(alone.logprobs), torch.tensor(t.logprobs), atol=1e-4, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["dense", "sparse", "split"])
def test_dsa_variants_capture_in_cuda_graphs(hf_checkpoint, variant):
    """Each DSA plan variant is capturable in a CUDA graph: the plan (dense / sparse / split) is
    made on the host before capture, replay re-runs it on new data, and the replayed logits and
    caches equal an eager run on the same inputs."""
    _, path = hf_checkpoint("v32")
    model = DeepseekForCausalLM.from_pretrained(path, progress=False, device="cuda")
    caps, ps = model.backend.capabilities, 4
    lens = {"dense": [5, 9], "sparse": [20, 30], "split": [5, 30]}[variant]
    pages, nxt = [], 0
    for n in lens:
        pages.append(list(range(nxt, nxt + -(-n // ps))))
        nxt += -(-n // ps)
    batch = build_batch(caps, [[1] * n for n in lens], [0] * len(lens), pages, ps, dsa=True,
                        dsa_dense_max_kv_len=TOPK, device="cuda")
    expected = {"dense": ForwardMethod.MHA, "sparse": ForwardMethod.SPARSE, "split": ForwardMethod.DSA_SPLIT}
    assert batch.method is expected[variant]
    caches = model.allocate_caches(32, ps)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        model(batch, caches)  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        logits = model(batch, caches)
    batch.input_ids.copy_(torch.randint(0, VOCAB, batch.input_ids.shape, device="cuda"))
    graph.replay()
    eager_caches = model.allocate_caches(32, ps)
    with torch.no_grad():
        want = model(batch, eager_caches)
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=0)
    for a, b in zip(caches.latent + caches.index, eager_caches.latent + eager_caches.index):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
