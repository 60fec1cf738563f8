"""Tensor / expert parallel models on gloo (CPU, spawned ranks, bounded time) against the
``tensor_parallel_size=1`` model: prompt logprobs and greedy tokens within 1e-5 (float32), for
V2, V3 and V3.2, from a config and from a checkpoint, eager and compiled."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from tests.model.conftest import VOCAB, hf_config, make_hf_model
from tests.ranks import join_gloo, spawn_ranks

KINDS = ("v2", "v3", "v32")


def _prompts() -> list[list[int]]:
    rnd = random.Random(0)
    return [[rnd.randrange(VOCAB) for _ in range(n)] for n in (5, 17, 30)]  # crosses index_topk 12


def _outputs(model, compile: bool):
    from mlagraph.model import Engine

    engine = Engine(model, max_num_seqs=4, max_model_len=64, page_size=4, compile=compile, progress=False,
                    prefill_chunk_size=8)
    logprobs = engine.prompt_logprobs(_prompts())
    tokens = engine.generate(_prompts(), max_new_tokens=4, ignore_eos=True)
    return logprobs, tokens


def _same(got, want) -> None:
    (lp, tok), (lp_want, tok_want) = got, want
    for a, b in zip(lp, lp_want):
        torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(b), rtol=0, atol=1e-5)
    assert [t.token_ids for t in tok] == [t.token_ids for t in tok_want]


def _worker(rank: int, world: int, init_method: str, ckpts: dict, compile: bool) -> None:
    join_gloo(rank, world, init_method)
    try:
        from mlagraph.model import DeepseekForCausalLM

        for kind in KINDS:
            single = DeepseekForCausalLM.from_config(hf_config(kind), seed=3)
            split = DeepseekForCausalLM.from_config(hf_config(kind), seed=3, tensor_parallel_size=world)
            heads = split.model.layers[0].self_attn.num_heads
            assert heads == single.model.layers[0].self_attn.num_heads // world, heads
            want = _outputs(single, compile=False)
            _same(_outputs(split, compile), want)
            if not compile:  # sampled tokens: every rank draws the same (same seed, same logits)
                from mlagraph.model import Engine

                sampled = Engine(split, max_num_seqs=4, max_model_len=64, page_size=4, progress=False).generate(
                    _prompts(), max_new_tokens=6, temperature=1.0, ignore_eos=True)
                mine = [o.token_ids for o in sampled]
                every = [None] * world
                dist.all_gather_object(every, mine)
                assert all(e == mine for e in every), every
            if kind in ckpts:  # from a checkpoint: each rank reads its slices
                with pytest.raises(ValueError, match="fp8_weights: 'keep' is not supported with tensor_parallel_size"):
                    DeepseekForCausalLM.from_pretrained(ckpts[kind], fp8_weights="keep", tensor_parallel_size=world)
                loaded = DeepseekForCausalLM.from_pretrained(ckpts[kind], progress=False, tensor_parallel_size=world)
                want = _outputs(DeepseekForCausalLM.from_pretrained(ckpts[kind], progress=False), compile=False)
                _same(_outputs(loaded, compile), want)
    finally:
        dist.destroy_process_group()



@pytest.mark.parametrize("world", [2, 4])
def test_eager_ranks_equal_one_rank(world, tmp_path):
    ckpts = {}
    for kind in ("v3",):
        make_hf_model(kind).save_pretrained(tmp_path / kind)
        ckpts[kind] = str(tmp_path / kind)
    spawn_ranks(_worker, world, ckpts, False)


def test_compiled_ranks_equal_one_rank():
    """mlagraph.compile on each rank (passes and lints over graphs with collectives)."""
    spawn_ranks(_worker, 2, {}, True)
