"""DeepseekForCausalLM.from_pretrained / from_config on checkpoints written by transformers.

Covers sharded checkpoints, every kind of mismatch (reported together in one ValueError),
DeepSeek's fp8 block-scaled weights, multi-token-prediction layers, stacked-expert checkpoints,
the progress bar, and config errors.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mlagraph.model import DeepseekConfig, DeepseekForCausalLM, Engine

from .conftest import INIT_STD, hf_config, hf_token_logprobs

SINGLE = "model.safetensors"


def _copy(path, tmp_path, name="ckpt"):
    dst = tmp_path / name
    shutil.copytree(path, dst)
    return dst


def _rewrite(ckpt, edit) -> None:
    """Loads the single-file checkpoint, lets ``edit(dict)`` change it, writes it back."""
    tensors = load_file(ckpt / SINGLE)
    edit(tensors)
    save_file(tensors, ckpt / SINGLE, metadata={"format": "pt"})


def _load(path, **kw) -> DeepseekForCausalLM:
    return DeepseekForCausalLM.from_pretrained(path, progress=False, **kw)


def _assert_state_dicts_equal(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


def _sections(message: str) -> dict[str, list[str]]:
    """Parses the loader's error: {"missing": [...], "unexpected": [...], "mis-shaped": [...]}."""
    out, current = {}, None
    for line in message.splitlines():
        head = re.match(r"^  (\d+) (missing|unexpected|mis-shaped) weight\(s\):$", line)
        if head:
            current = out.setdefault(head.group(2), [])
            assert int(head.group(1)) >= 1
        elif line.startswith("    ") and current is not None:
            current.append(line.strip())
    return out


# --- sharding and exact weights ---------------------------------------------------------------


def test_loaded_weights_are_transformers_weights(hf_checkpoint):
    """Per-expert tensors on disk are stacked back exactly into transformers' own layout."""
    hf, path = hf_checkpoint("v3")
    ours = _load(path).state_dict()
    theirs = {k: v for k, v in hf.state_dict().items() if "rotary_emb" not in k}
    _assert_state_dicts_equal(ours, theirs)


def test_sharded_checkpoint_loads_like_unsharded(hf_checkpoint, tmp_path):
    hf, path = hf_checkpoint("v3")
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="20KB")
    index = sharded / "model.safetensors.index.json"
    assert index.exists() and not (sharded / SINGLE).exists()
    shards = set(json.loads(index.read_text())["weight_map"].values())
    assert len(shards) > 3
    _assert_state_dicts_equal(_load(sharded).state_dict(), _load(path).state_dict())


def test_stacked_expert_checkpoint_loads(hf_checkpoint, tmp_path):
    """A checkpoint holding mlp.experts.gate_up_proj / down_proj directly (no per-expert split)."""
    hf, path = hf_checkpoint("v3")
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    shutil.copy(path / "config.json", stacked / "config.json")
    tensors = {k: v.contiguous() for k, v in hf.state_dict().items() if "rotary_emb" not in k}
    assert "model.layers.1.mlp.experts.gate_up_proj" in tensors
    save_file(tensors, stacked / SINGLE, metadata={"format": "pt"})
    _assert_state_dicts_equal(_load(stacked).state_dict(), _load(path).state_dict())


# --- mismatches ----------------------------------------------------------------------------


def test_missing_weight_is_named(hf_checkpoint, tmp_path):
    ckpt = _copy(hf_checkpoint("v3")[1], tmp_path)
    _rewrite(ckpt, lambda t: t.pop("model.layers.0.self_attn.kv_b_proj.weight"))
    with pytest.raises(ValueError) as e:
        _load(ckpt)
    assert _sections(str(e.value)) == {"missing": ["model.layers.0.self_attn.kv_b_proj.weight"]}


def test_unexpected_weight_is_named(hf_checkpoint, tmp_path):
    ckpt = _copy(hf_checkpoint("v3")[1], tmp_path)
    _rewrite(ckpt, lambda t: t.update({"model.layers.0.self_attn.extra_proj.weight": torch.zeros(3, 4)}))
    with pytest.raises(ValueError) as e:
        _load(ckpt)
    assert _sections(str(e.value)) == {"unexpected": ["model.layers.0.self_attn.extra_proj.weight"]}


def test_misshaped_weight_is_named_with_both_shapes(hf_checkpoint, tmp_path):
    ckpt = _copy(hf_checkpoint("v3")[1], tmp_path)
    key = "model.layers.1.self_attn.o_proj.weight"
    _rewrite(ckpt, lambda t: t.update({key: t[key][:, :63].contiguous()}))
    with pytest.raises(ValueError) as e:
        _load(ckpt)
    assert _sections(str(e.value)) == {"mis-shaped": [f"{key}: expected [64, 64], got [64, 63]"]}


def test_missing_expert_is_named(hf_checkpoint, tmp_path):
    ckpt = _copy(hf_checkpoint("v3")[1], tmp_path)
    key = "model.layers.1.mlp.experts.5.up_proj.weight"
    _rewrite(ckpt, lambda t: t.pop(key))
    with pytest.raises(ValueError) as e:
        _load(ckpt)
    msg = str(e.value)
    assert key in msg and "missing" in msg
    # only that expert is reported, not its neighbours or the other projections
    assert "experts.4." not in msg and "experts.6." not in msg and "down_proj" not in msg


def test_misshaped_expert_is_reported_once(hf_checkpoint, tmp_path):
    ckpt = _copy(hf_checkpoint("v3")[1], tmp_path)
    key = "model.layers.1.mlp.experts.0.gate_proj.weight"
    _rewrite(ckpt, lambda t: t.update({key: torch.zeros(31, 64)}))
    with pytest.raises(ValueError) as e:
        _load(ckpt)
    assert _sections(str(e.value)) == {"mis-shaped": [f"{key}: expected [32, 64], got [31, 64]"]}


def test_all_problems_reported_together(hf_checkpoint, tmp_path):
    ckpt = _copy(hf_checkpoint("v3")[1], tmp_path)
    missing = "model.layers.0.mlp.up_proj.weight"
    extra = "model.layers.1.mlp.experts.8.gate_proj.weight"  # expert index past n_routed_experts
    shaped = "model.embed_tokens.weight"
    expert = "model.layers.1.mlp.experts.2.down_proj.weight"

    def edit(t):
        t.pop(missing)
        t.pop(expert)
        t[extra] = torch.zeros(32, 64)
        t[shaped] = torch.zeros(95, 64)

    _rewrite(ckpt, edit)
    with pytest.raises(ValueError) as e:
        _load(ckpt)
    msg = str(e.value)
    sec = _sections(msg)
    assert sec["missing"] == [missing]
    assert sec["unexpected"] == [extra]
    assert f"{shaped}: expected [96, 64], got [95, 64]" in sec["mis-shaped"]
    assert expert in msg
    assert str(ckpt) in msg


# --- fp8 block-scaled weights and MTP layers -------------------------------------------------


def _fp8_hf_model():
    """Wider than conftest's so fp8 blocks are ragged in both dims: gate_proj [272, 160]."""
    cfg = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=160, intermediate_size=272, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1, n_group=2, topk_group=1, norm_topk_prob=True, max_position_embeddings=64,
        initializer_range=INIT_STD, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.DeepseekV3ForCausalLM(cfg).float().eval()


def _quantize_blockwise(w: torch.Tensor, g: torch.Generator):
    """An e4m3 tensor and a [ceil(out/128), ceil(in/128)] float32 scale, as DeepSeek stores them,
    and the dequantized weight they stand for, computed block by block (independently of the
    loader's vectorised dequantization). Scales are amax/448 times a random factor in [1, 2), so
    nothing clips and the rounding error is e4m3's: <= 2^-4 relative, plus 2^-10 * scale near 0.
    """
    out_f, in_f = w.shape
    sb = (math.ceil(out_f / 128), math.ceil(in_f / 128))
    scale = torch.empty(sb)
    q = torch.empty(out_f, in_f, dtype=torch.float8_e4m3fn)
    expected = torch.empty(out_f, in_f)
    for i in range(sb[0]):
        for j in range(sb[1]):
            rows, cols = slice(128 * i, 128 * (i + 1)), slice(128 * j, 128 * (j + 1))
            scale[i, j] = w[rows, cols].abs().max() / 448 * (1 + torch.rand((), generator=g))
            blk = (w[rows, cols] / scale[i, j]).to(torch.float8_e4m3fn)
            q[rows, cols] = blk
            expected[rows, cols] = blk.float() * scale[i, j]
    err = (expected - w).abs()
    assert err.max() > 0  # the quantization really loses something
    s_full = scale.repeat_interleave(128, 0)[:out_f].repeat_interleave(128, 1)[:, :in_f]
    assert torch.all(err <= 2**-4 * w.abs() + 2**-10 * s_full)
    return q, scale, expected


def test_fp8_block_scaled_weights_and_mtp_layers(tmp_path):
    hf = _fp8_hf_model()
    ckpt = tmp_path / "fp8"
    hf.save_pretrained(ckpt)
    tensors = load_file(ckpt / SINGLE)
    g = torch.Generator().manual_seed(1)
    fp8_keys = [
        "model.layers.0.mlp.gate_proj.weight",  # [272, 160]: 3 x 2 blocks, both ragged
        "model.layers.0.mlp.down_proj.weight",  # [160, 272]
        "model.layers.1.mlp.experts.3.down_proj.weight",  # a routed expert, [160, 32]
        "model.layers.1.self_attn.q_b_proj.weight",  # [48, 48]: one partial block
    ]
    expected = {}
    for key in fp8_keys:
        q, scale, want = _quantize_blockwise(tensors[key], g)
        tensors[key], tensors[key + "_scale_inv"] = q, scale
        expected[key] = want
    # multi-token-prediction layer 2 (== num_hidden_layers), with an fp8 weight of its own, in a
    # checkpoint whose config says it has none: skipped (incomplete, it would be reported;
    # complete ones load: tests/model/test_mtp.py)
    config = json.loads((ckpt / "config.json").read_text())
    config["num_nextn_predict_layers"] = 0
    (ckpt / "config.json").write_text(json.dumps(config))
    mtp = {
        "model.layers.2.eh_proj.weight": torch.randn(160, 320),
        "model.layers.2.enorm.weight": torch.ones(160),
        "model.layers.2.self_attn.q_a_proj.weight": torch.randn(48, 160).to(torch.float8_e4m3fn),
        "model.layers.2.self_attn.q_a_proj.weight_scale_inv": torch.ones(1, 2),
        "model.layers.2.mlp.experts.0.gate_proj.weight": torch.randn(32, 160),
        "model.layers.2.shared_head.head.weight": torch.randn(64, 160),
    }
    tensors.update(mtp)
    save_file(tensors, ckpt / SINGLE, metadata={"format": "pt"})

    model = _load(ckpt)
    sd = model.state_dict()
    for key, want in expected.items():
        m = re.match(r"(.*\.experts)\.(\d+)\.down_proj\.weight", key)
        got = sd[m.group(1) + ".down_proj"][int(m.group(2))] if m else sd[key]
        assert torch.equal(got, want), key
    # every other weight is exactly transformers'
    for key, value in hf.state_dict().items():
        if "rotary_emb" in key or key in expected:
            continue
        if key.endswith("experts.down_proj"):
            value = value.clone()
            value[3] = sd[key][3]
        assert torch.equal(sd[key], value), key

    # and the model computes with the dequantized weights: same logprobs as transformers
    # holding those weights
    with torch.no_grad():
        for key, want in expected.items():
            m = re.match(r"(.*\.experts)\.(\d+)\.down_proj\.weight", key)
            if m:
                hf.get_parameter(m.group(1) + ".down_proj")[int(m.group(2))].copy_(want)
            else:
                hf.get_parameter(key).copy_(want)
    ids = [3, 17, 42, 8, 8, 61, 0, 25, 11]
    got = Engine(model, max_num_seqs=1, max_model_len=32, page_size=4).prompt_logprobs([ids])[0]
    torch.testing.assert_close(got, hf_token_logprobs(hf, ids), atol=1e-4, rtol=0)


def test_fp8_scale_in_another_shard(tmp_path):
    """A sharded fp8 checkpoint may hold a weight and its scale in different files."""
    hf = _fp8_hf_model()
    ckpt = tmp_path / "fp8_sharded"
    hf.save_pretrained(ckpt)
    tensors = load_file(ckpt / SINGLE)
    os.remove(ckpt / SINGLE)
    key = "model.layers.0.mlp.gate_proj.weight"
    q, scale, want = _quantize_blockwise(tensors[key], torch.Generator().manual_seed(2))
    tensors[key] = q
    shard_b = {key + "_scale_inv": scale, "model.norm.weight": tensors.pop("model.norm.weight")}
    shard_a = tensors
    save_file(shard_a, ckpt / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file(shard_b, ckpt / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    weight_map = {k: "model-00001-of-00002.safetensors" for k in shard_a}
    weight_map.update({k: "model-00002-of-00002.safetensors" for k in shard_b})
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert torch.equal(_load(ckpt).state_dict()[key], want)


def test_fp8_weight_without_scale_is_an_error(tmp_path):
    hf = _fp8_hf_model()
    ckpt = tmp_path / "fp8_noscale"
    hf.save_pretrained(ckpt)
    key = "model.layers.0.mlp.up_proj.weight"
    _rewrite(ckpt, lambda t: t.update({key: t[key].to(torch.float8_e4m3fn)}))
    with pytest.raises(ValueError, match=re.escape(key + "_scale_inv")):
        _load(ckpt)


# --- progress bar ----------------------------------------------------------------------------


def test_progress_bar(hf_checkpoint, tmp_path, capfd):
    hf, _ = hf_checkpoint("v3")
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="20KB")
    n = len(set(json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"].values()))
    capfd.readouterr()
    DeepseekForCausalLM.from_pretrained(sharded, progress=True)
    out, err = capfd.readouterr()
    assert "loading checkpoint" in err and f"{n}/{n}" in err
    assert out == ""
    DeepseekForCausalLM.from_pretrained(sharded, progress=False)
    assert capfd.readouterr() == ("", "")


# --- from_config and config errors -----------------------------------------------------------


def test_from_config_dict_object_and_path_agree(hf_checkpoint):
    _, path = hf_checkpoint("v3")
    obj = hf_config("v3")
    from_obj = DeepseekForCausalLM.from_config(obj)
    from_dict = DeepseekForCausalLM.from_config(obj.to_dict())
    from_path = DeepseekForCausalLM.from_config(os.fspath(path / "config.json"))
    _assert_state_dicts_equal(from_obj.state_dict(), from_dict.state_dict())
    _assert_state_dicts_equal(from_obj.state_dict(), from_path.state_dict())
    assert from_obj.config == from_dict.config == from_path.config
    # initializer_range (0.2) is used, and init_std overrides it
    w = from_obj.model.layers[0].self_attn.kv_b_proj.weight
    assert 0.15 < w.std() < 0.25
    w_small = DeepseekForCausalLM.from_config(obj, init_std=0.02).model.layers[0].self_attn.kv_b_proj.weight
    assert 0.015 < w_small.std() < 0.025
    # a different seed gives different weights
    assert not torch.equal(DeepseekForCausalLM.from_config(obj, seed=1).model.layers[0].self_attn.kv_b_proj.weight, w)

    prompts = [[1, 5, 9, 2, 40, 7], [3, 3]]
    lp = [Engine(m, max_num_seqs=2, max_model_len=16, page_size=4).prompt_logprobs(prompts) for m in (from_obj, from_dict)]
    for a, b in zip(*lp):
        assert torch.isfinite(a).all() and torch.equal(a, b)


def test_from_config_matches_config_fields():
    cfg = DeepseekForCausalLM.from_config(hf_config("v32")).config
    assert cfg.model_type == "deepseek_v32" and cfg.uses_dsa and cfg.index_topk == 12
    assert cfg.kv_lora_rank == 32 and cfg.q_lora_rank == 48 and cfg.n_routed_experts == 8
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["factor"] == 4.0
    v2 = DeepseekForCausalLM.from_config(hf_config("v2")).config
    assert v2.scoring_func == "softmax" and v2.topk_method == "greedy" and v2.q_lora_rank is None


def test_config_errors_name_the_problem():
    d = hf_config("v3").to_dict()
    with pytest.raises(ValueError, match=r"model_type.*'llama'"):
        DeepseekConfig.from_hf({**d, "model_type": "llama"})
    with pytest.raises(ValueError, match="model_type.*'llama'"):
        DeepseekForCausalLM.from_config({**d, "model_type": "llama"})
    for key in ("kv_lora_rank", "vocab_size", "qk_rope_head_dim"):
        broken = {k: v for k, v in d.items() if k != key}
        with pytest.raises(ValueError, match=f"missing required key '{key}'"):
            DeepseekConfig.from_hf(broken)
    with pytest.raises(ValueError, match="qk_rope_head_dim: expected an even number, got 7"):
        DeepseekConfig.from_hf({**d, "qk_rope_head_dim": 7})
    with pytest.raises(ValueError, match="num_experts_per_tok: expected 1..8, got 9"):
        DeepseekConfig.from_hf({**d, "num_experts_per_tok": 9})


def test_from_pretrained_errors_name_the_path(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hf_config("v3").to_dict()))
    with pytest.raises(ValueError, match=re.escape(repr(str(tmp_path)))):
        _load(tmp_path)  # a config but no weights
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**hf_config("v3").to_dict(), "model_type": "mistral"}))
    with pytest.raises(ValueError, match="mistral"):
        _load(bad)


def test_tied_embeddings_checkpoint(tmp_path):
    """tie_word_embeddings: transformers writes no lm_head.weight; the head is the embedding."""
    from .conftest import YARN, _common

    cfg = transformers.DeepseekV3Config(
        **_common(q_lora_rank=48, n_group=4, topk_group=2, tie_word_embeddings=True), rope_parameters=dict(YARN)
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(cfg).float().eval()
    hf.save_pretrained(tmp_path)
    with safe_open(tmp_path / SINGLE, framework="pt") as f:
        assert "lm_head.weight" not in f.keys()
    model = _load(tmp_path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = [1, 5, 9, 22, 3, 3, 80]
    got = Engine(model, max_num_seqs=1, max_model_len=16, page_size=4).prompt_logprobs([ids])[0]
    torch.testing.assert_close(got, hf_token_logprobs(hf, ids), atol=1e-4, rtol=0)
