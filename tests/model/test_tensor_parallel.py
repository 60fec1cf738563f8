"""Tensor / expert parallel models on gloo (CPU, spawned ranks, bounded time) against the
``tensor_parallel_size=1`` model: prompt logprobs and greedy tokens within 1e-5 (float32), for
V2, V3 and V3.2, from a config and from a checkpoint, eager and compiled."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from tests.model.conftest import VOCAB, hf_config, make_hf_model
from tests.ranks import gloo_group, spawn_ranks

KINDS = ("v2", "v3", "v32")


def _prompts() -> list[list[int]]:
    rnd = random.Random(0)
    return [[rnd.randrange(VOCAB) for _ in range(n)] for n in (5, 17, 30)]  # crosses index_topk 12


def _outputs(model, compile: bool, prompts=None):
    from mlagraph.model import Engine

    prompts = prompts or _prompts()
    engine = Engine(model, max_num_seqs=4, max_model_len=64, page_size=4, compile=compile, progress=False,
                    prefill_chunk_size=8)
    logprobs = engine.prompt_logprobs(prompts)
    tokens = engine.generate(prompts, max_new_tokens=4, ignore_eos=True)
    return logprobs, tokens


def _same(got, want) -> None:
    (lp, tok), (lp_want, tok_want) = got, want
    for a, b in zip(lp, lp_want):
        torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(b), rtol=0, atol=1e-5)
    assert [t.token_ids for t in tok] == [t.token_ids for t in tok_want]


def _worker(rank: int, world: int, init_method: str, ckpts: dict, compile: bool) -> None:
    with gloo_group(rank, world, init_method):
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
                loaded = DeepseekForCausalLM.from_pretrained(ckpts[kind], progress=False, tensor_parallel_size=world)
                want = _outputs(DeepseekForCausalLM.from_pretrained(ckpts[kind], progress=False), compile=False)
                _same(_outputs(loaded, compile), want)



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


def _fp8_worker(rank: int, world: int, init_method: str, path: str) -> None:
    with gloo_group(rank, world, init_method):
        from mlagraph.model import DeepseekForCausalLM
        from mlagraph.model.fp8_weights import Fp8Linear
        from mlagraph.ops.fp8 import FP8_DTYPE

        with pytest.raises(ValueError, match=r"fp8_weights='keep' with tensor_parallel_size=2: .*q_b_proj.* whole 128x128"):
            DeepseekForCausalLM.from_pretrained(path, fp8_weights="keep", tensor_parallel_size=world, progress=False)
        split = DeepseekForCausalLM.from_pretrained(path, tensor_parallel_size=world, progress=False)  # "auto"
        one = DeepseekForCausalLM.from_pretrained(path, progress=False)
        dense, moe, attn = split.model.layers[0].mlp, split.model.layers[1].mlp, split.model.layers[0].self_attn
        whole = one.model.layers[0].mlp
        # 256 of the dense MLP's 512 rows (columns for down) a rank: fp8, with their blocks' scales
        for name, dim in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1)):
            mine, full = getattr(dense, name), getattr(whole, name)
            assert isinstance(mine, Fp8Linear) and tuple(mine.weight.shape) == (256, 256)
            rows = full.weight.narrow(dim, rank * 256, 256)
            assert torch.equal(mine.weight.view(torch.uint8), rows.view(torch.uint8)), name
            assert torch.equal(mine.weight_scale_inv, full.weight_scale_inv.narrow(dim, rank * 2, 2)), name
        assert isinstance(moe.shared_experts.gate_proj, Fp8Linear)  # 128 of 256 rows a rank
        assert moe.experts.gate_up_proj.dtype == FP8_DTYPE and moe.experts.gate_up_proj.shape[0] == 2  # 2 of 4 experts
        assert isinstance(attn.q_a_proj, Fp8Linear)  # replicated: whole
        assert not isinstance(attn.q_b_proj, Fp8Linear)  # 24 of its 48 rows a rank: dequantized at load
        assert not isinstance(attn.o_proj, Fp8Linear)  # 16 of its 32 columns a rank
        prompts = [[3, 17, 42, 8, 8, 61, 0, 25, 11], [5, 60, 2, 33]]  # the checkpoint's vocabulary is 64
        _same(_outputs(split, False, prompts), _outputs(one, False, prompts))


def test_fp8_weights_stay_fp8_across_ranks(tmp_path):
    """fp8 checkpoints under tensor parallelism: each rank keeps its slice of an fp8 weight in
    e4m3 with its blocks' scales where the slices are whole 128x128 blocks, dequantizes the
    others under "auto" ("keep" names them and raises); equal to one rank's fp8 model."""
    from tests.model.test_fp8_weights import write_fp8_checkpoint

    write_fp8_checkpoint(tmp_path, moe_intermediate_size=256, intermediate_size=512)
    spawn_ranks(_fp8_worker, 2, str(tmp_path))
