"""V4's dense-instead-of-sparse plan: when no request has more CSA entries than index_topk, the
indexer's selection would keep them all, so the step attends every entry (HCA's op) and skips
the indexer's scoring and top-k, exactly, while still writing the indexer's keys for later
sparse steps (DESIGN.md, lesson 8)."""

from __future__ import annotations

import random

import torch

from mlagraph.model import DeepseekForCausalLM, Engine, build_batch
from tests.helpers import NoHostSync

from .conftest import hf_token_logprobs
from .test_oracle_v4 import TOL, VOCAB, v4  # noqa: F401  (v4: the module's checkpoint fixture)


def _prompts(seed, lengths):
    rnd = random.Random(seed)
    return [[rnd.randrange(VOCAB) for _ in range(n)] for n in lengths]


def _engine(path, **kw):
    model = DeepseekForCausalLM.from_pretrained(path, progress=False)
    return Engine(model, max_num_seqs=4, max_model_len=64, page_size=4, **kw)


def test_limit_is_where_selection_keeps_everything(v4):
    _, path = v4
    cfg = DeepseekForCausalLM.from_pretrained(path, progress=False).config
    assert cfg.uses_dsa and (cfg.index_topk, cfg.csa_compress_rate) == (3, 2)
    assert cfg.dsa_dense_max_kv_len == 7  # 7 tokens close 3 entries; the 8th closes a 4th
    assert _engine(path).dsa_dense_max_kv_len == 7


def test_dense_plan_equals_sparse_up_to_the_limit_and_not_beyond(v4):
    hf, path = v4
    sparse = _engine(path, dsa_dense_max_kv_len=0)  # never dense
    dense = _engine(path)
    # 9 tokens: position 7 sees 4 entries (> index_topk), and its prediction is a prompt logprob
    loose = _engine(path, dsa_dense_max_kv_len=9)
    short = _prompts(1, [7, 5, 2])
    for ids, a, b in zip(short, dense.prompt_logprobs(short), sparse.prompt_logprobs(short)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
        torch.testing.assert_close(a, hf_token_logprobs(hf, ids), atol=TOL, rtol=0)
    nine = _prompts(2, [9])
    assert (loose.prompt_logprobs(nine)[0] - sparse.prompt_logprobs(nine)[0]).abs().max() > 100 * TOL


def test_generation_crossing_the_limit_reads_the_keys_dense_steps_wrote(v4):
    """Prefill (and the first decodes) dense, later decodes sparse: the indexer keys the dense
    steps wrote must be right, or the sparse steps' selection would differ from the oracle's."""
    hf, path = v4
    prompts = _prompts(3, [5, 3])
    dense, sparse = _engine(path).generate(prompts, max_new_tokens=12), _engine(
        path, dsa_dense_max_kv_len=0).generate(prompts, max_new_tokens=12)
    for ids, a, b in zip(prompts, dense, sparse):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
        full = ids + a.token_ids
        want = hf_token_logprobs(hf, full)[len(ids) - 1:]
        torch.testing.assert_close(torch.tensor(a.logprobs), want, atol=TOL, rtol=0)


def test_dense_step_runs_no_indexer_scoring_but_writes_its_keys(v4):
    _, path = v4
    model = DeepseekForCausalLM.from_pretrained(path, progress=False)
    cfg, caps = model.config, model.backend.capabilities
    n_csa = sum(t == "compressed_sparse_attention" for t in cfg.layer_types)
    n_hca = sum(t == "heavily_compressed_attention" for t in cfg.layer_types)
    ops = {}
    for name, ids in (("dense", _prompts(4, [6])[0]), ("sparse", _prompts(4, [12])[0])):
        caches = model.allocate_caches(8, 4)
        batch = build_batch(caps, [ids], [0], [[0, 1, 2]], 4, dsa=True, dsa_dense_max_kv_len=cfg.dsa_dense_max_kv_len)
        assert batch.plan.dsa_dense == (name == "dense")
        with NoHostSync() as mode:
            model(batch, caches)
        ops[name] = mode.ops_seen
    assert "mlagraph::csa_indexer_topk" not in ops["dense"] and "mlagraph::csa_attention" not in ops["dense"]
    assert ops["dense"].count("mlagraph::hca_attention") == n_csa + n_hca
    # the indexer's compressor still ran in every CSA layer: its keys are written
    assert ops["dense"].count("mlagraph::compressor_update") == 2 * n_csa + n_hca
    assert ops["sparse"].count("mlagraph::csa_indexer_topk") == n_csa
    assert ops["sparse"].count("mlagraph::csa_attention") == n_csa
