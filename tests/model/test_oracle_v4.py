"""mlagraph's DeepSeek-V4 against transformers' DeepseekV4ForCausalLM (the oracle), in float32.

The tiny config has every layer type (sliding, CSA, HCA), both MoE kinds (hash, top-k), a
sliding window, compression rates and an indexer top-k small enough that the prompts cross
them, YaRN on the compressed layers, and weights at initializer range 0.2 with random sinks,
position biases, hyper-connection biases and routing tables, so a RoPE, mask or compressor
bug moves logprobs far past the tolerance (the test_*_matters tests below show it does).
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

import transformers
from mlagraph.model import DeepseekForCausalLM, Engine
from mlagraph.model.deepseek_v4 import DeepseekV4ForCausalLM

from .conftest import INIT_STD, VOCAB, hf_logits, hf_token_logprobs

TOL = 1e-4
LAYER_TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
               "compressed_sparse_attention"]


def v4_config(**over) -> transformers.DeepseekV4Config:
    kw = dict(
        vocab_size=VOCAB, hidden_size=48, moe_intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
        head_dim=16, qk_rope_head_dim=8, q_lora_rank=24, o_groups=2, o_lora_rank=12,
        n_routed_experts=6, num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=1.5,
        layer_types=LAYER_TYPES, mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
        sliding_window=6, index_n_heads=8, index_head_dim=16, index_topk=3,
        hc_mult=3, hc_sinkhorn_iters=5, max_position_embeddings=256, initializer_range=INIT_STD, swiglu_limit=2.0,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "beta_fast": 32, "beta_slow": 1},
    )
    kw.update(over)
    return transformers.DeepseekV4Config(**kw)


def make_hf_v4(seed: int = 0, **over):
    cfg = v4_config(**over)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.DeepseekV4ForCausalLM(cfg).float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # transformers zeroes these; random values make every one of them count
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "position_bias", "_hc.base", "hc_base")):
                p.copy_(torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.rand(b.shape, generator=g) * 0.2)
            elif name.endswith("tid2eid"):
                b.copy_(torch.rand(VOCAB, cfg.n_routed_experts, generator=g).argsort(-1)[:, : b.shape[1]])
    return model


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    """(transformers model, its save_pretrained directory)."""
    model = make_hf_v4()
    path = tmp_path_factory.mktemp("ckpt_v4")
    model.save_pretrained(path)
    return model, path


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(VOCAB) for _ in range(n)] for n in lengths]


def _engine(path_or_model, page_size: int = 4, **kw) -> Engine:
    model = path_or_model
    if not isinstance(model, torch.nn.Module):
        model = DeepseekForCausalLM.from_pretrained(path_or_model, progress=False)
    return Engine(model, max_num_seqs=4, max_model_len=128, page_size=page_size, **kw)


def test_from_pretrained_dispatches_to_v4(v4):
    _, path = v4
    model = DeepseekForCausalLM.from_pretrained(path, progress=False)
    assert isinstance(model, DeepseekV4ForCausalLM)
    assert [layer.self_attn.kind for layer in model.model.layers] == LAYER_TYPES


# page size 2: an HCA entry (rate 4) spans two pages; chunk 1: every prompt token is a decode-like step
@pytest.mark.parametrize("page_size,chunk_size", [(4, None), (4, 5), (4, 1), (2, None), (2, 3)])
def test_prompt_logprobs_match_transformers(v4, page_size, chunk_size):
    hf, path = v4
    prompts = _prompts(1, [9, 30, 17])
    got = _engine(path, page_size).prompt_logprobs(prompts, chunk_size=chunk_size)
    for ids, lp in zip(prompts, got):
        assert lp.shape == (len(ids) - 1,)
        torch.testing.assert_close(lp, hf_token_logprobs(hf, ids), atol=TOL, rtol=0)


def test_greedy_generation_matches_teacher_forcing(v4):
    hf, path = v4
    prompts = _prompts(2, [6, 21])
    outs = _engine(path).generate(prompts, max_new_tokens=10, temperature=0.0)
    for ids, out in zip(prompts, outs):
        assert len(out.token_ids) == 10 and out.finish_reason == "length"
        logp = torch.log_softmax(hf_logits(hf, ids + out.token_ids)[len(ids) - 1 : -1], dim=-1)
        want = logp.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.logprobs), want, atol=TOL, rtol=0)
        assert torch.all(want >= logp.max(dim=-1).values - TOL)  # each token is the oracle's argmax


def test_batched_and_chunked_generation_equal_alone(v4):
    """Requests decoded together, and prompts prefilled in chunks beside decodes (mixed
    batches), give the same tokens and logprobs as each request alone."""
    _, path = v4
    prompts = _prompts(3, [5, 19, 2, 13])
    together = _engine(path).generate(prompts, max_new_tokens=6)
    chunked = _engine(path, prefill_chunk_size=6).generate(prompts, max_new_tokens=6)
    for p, a, c in zip(prompts, together, chunked):
        alone = _engine(path).generate([p], max_new_tokens=6)[0]
        for other in (a, c):
            assert other.token_ids == alone.token_ids
            torch.testing.assert_close(torch.tensor(other.logprobs), torch.tensor(alone.logprobs), atol=TOL, rtol=0)


def test_deepseek_and_transformers_names_both_load(v4, tmp_path):
    """DeepSeek's own on-disk names without the ``model.`` prefix (``embed.weight``,
    ``layers.0.attn.wq_a.weight``, ``hc_head_fn``) and transformers' in-memory names load the
    same weights."""
    hf, path = v4
    ref = DeepseekForCausalLM.from_pretrained(path, progress=False).state_dict()
    disk = load_file(os.path.join(path, "model.safetensors"))

    def deepseek_name(k: str) -> str:
        k = k.removeprefix("model.")
        k = {"embed_tokens.weight": "embed.weight"}.get(k, k)
        return k.replace("hc_head.hc_", "hc_head_")

    for name, tensors in (("deepseek", {deepseek_name(k): v for k, v in disk.items()}),
                          ("transformers", {k: v.contiguous() for k, v in hf.state_dict().items()})):
        d = tmp_path / name
        d.mkdir()
        save_file(tensors, d / "model.safetensors")
        with open(d / "config.json", "w") as f:
            json.dump(json.load(open(os.path.join(path, "config.json"))), f)
        got = DeepseekForCausalLM.from_pretrained(d, progress=False).state_dict()
        assert got.keys() == ref.keys()
        for k in ref:
            assert torch.equal(got[k], ref[k]), (name, k)


def test_unknown_checkpoint_weight_is_reported(v4, tmp_path):
    _, path = v4
    tensors = load_file(os.path.join(path, "model.safetensors"))
    tensors["model.layers.0.attn.surprise.weight"] = torch.zeros(1)
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(open(os.path.join(path, "config.json")).read())
    with pytest.raises(ValueError, match=r"(?s)1 unexpected weight.*self_attn\.surprise"):
        DeepseekForCausalLM.from_pretrained(tmp_path, progress=False)


# ---------------------------------------------------------------------------------------------
# the comparisons have teeth


def _max_diff(model, hf, ids) -> float:
    return float((_engine(model).prompt_logprobs([ids])[0] - hf_token_logprobs(hf, ids)).abs().max())


def test_window_matters(v4):
    hf, path = v4
    ids = _prompts(5, [40])[0]
    model = DeepseekForCausalLM.from_pretrained(path, progress=False)
    assert _max_diff(model, hf, ids) < TOL
    for layer in model.model.layers:
        layer.self_attn.window = 1000  # full causal attention instead of the window
    assert _max_diff(model, hf, ids) > 100 * TOL


def test_indexer_selection_matters(v4):
    """Past index_topk entries, the oracle with top-k = everything differs from the real one."""
    hf, path = v4
    ids = _prompts(5, [40])[0]
    model = DeepseekForCausalLM.from_pretrained(path, progress=False)
    for layer in model.model.layers:
        if layer.self_attn.compressor is not None and hasattr(layer.self_attn.compressor, "indexer"):
            layer.self_attn.compressor.indexer.topk = 1000
    assert _max_diff(model, hf, ids) > 100 * TOL


def test_compressed_rope_matters(v4):
    """The compressed layers' YaRN table in place of the sliding layers' plain one shows."""
    hf, path = v4
    ids = _prompts(5, [40])[0]
    model = DeepseekForCausalLM.from_pretrained(path, progress=False)
    model.rope_compress = model.rope_main
    assert _max_diff(model, hf, ids) > 100 * TOL


def test_steps_have_no_host_sync_and_decode_takes_the_decode_ops(v4):
    """A prefill step runs the token-major attentions, a decode step their decode forms, both
    without a host sync (so capturable), and the decode step's logits are the oracle's."""
    from mlagraph.model import build_batch
    from tests.helpers import NoHostSync

    hf, path = v4
    model = DeepseekForCausalLM.from_pretrained(path, progress=False)
    caps = model.backend.capabilities
    ids = _prompts(7, [14])[0]
    pages = [3, 0, 5, 1]
    caches = model.allocate_caches(8, 4)
    with NoHostSync() as prefill_mode:
        model(build_batch(caps, [ids[:-1]], [0], [pages], 4), caches)
    with NoHostSync() as decode_mode:
        logits = model(build_batch(caps, [ids[-1:]], [len(ids) - 1], [pages], 4, is_decode=[True]), caches)
    for kind in ("swa", "hca", "csa"):
        token_major, batch_major = f"mlagraph::{kind}_attention", f"mlagraph::{kind}_decode"
        assert token_major in prefill_mode.ops_seen and batch_major not in prefill_mode.ops_seen
        assert batch_major in decode_mode.ops_seen and token_major not in decode_mode.ops_seen
    torch.testing.assert_close(torch.log_softmax(logits[0], -1), torch.log_softmax(hf_logits(hf, ids)[-1], -1),
                               atol=TOL, rtol=0)
