"""DeepSeek fp8 checkpoints (e4m3 + weight_scale_inv per 128x128 block + quantization_config)
loaded with their weights kept in fp8: which layers, the bytes, the logprobs, the errors.

The checkpoint is a tiny DeepSeek-V3 written by transformers whose 2-d linear and expert
weights the test quantizes blockwise, as DeepSeek does, dims chosen so blocks are both whole
(hidden 256, experts' intermediate 128) and ragged (q_b_proj [48, 128], dense MLP [384, 256]).
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from mlagraph.model import DeepseekForCausalLM, Engine
from mlagraph.model.fp8_weights import Fp8Linear
from mlagraph.ops.fp8 import FP8_DTYPE, quantize_blockwise

from .conftest import INIT_STD, hf_token_logprobs

SINGLE = "model.safetensors"
QUANT = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
# Kept in the model dtype: read directly (kv_b_proj) or never quantized by DeepSeek (router,
# embeddings, norms, head).
_NOT_QUANTIZED = re.compile(r"embed_tokens|lm_head|norm|mlp\.gate\.weight|e_score|rotary")
IDS = [3, 17, 42, 8, 8, 61, 0, 25, 11]


def _hf_model(moe_intermediate_size=128, intermediate_size=384):
    cfg = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=256, intermediate_size=intermediate_size, moe_intermediate_size=moe_intermediate_size,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=32, q_lora_rank=128,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, first_k_dense_replace=1, n_group=2, topk_group=1, norm_topk_prob=True,
        max_position_embeddings=64, initializer_range=INIT_STD, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.DeepseekV3ForCausalLM(cfg).float().eval()


def write_fp8_checkpoint(path, quantization_config=QUANT, moe_intermediate_size=128, intermediate_size=384) -> list[str]:
    """A transformers checkpoint with every 2-d linear/expert weight in e4m3 + block scales;
    returns the quantized keys."""
    _hf_model(moe_intermediate_size, intermediate_size).save_pretrained(path)
    tensors = load_file(path / SINGLE)
    quantized = [k for k, v in tensors.items() if v.dim() == 2 and not _NOT_QUANTIZED.search(k)]
    for key in quantized:
        tensors[key], tensors[key + "_scale_inv"] = quantize_blockwise(tensors[key])
    save_file(tensors, path / SINGLE, metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config))
    return quantized


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8")
    return path, write_fp8_checkpoint(path)


def _load(path, **kw):
    return DeepseekForCausalLM.from_pretrained(path, progress=False, **kw)


def _logprobs(model, ids=IDS):
    return Engine(model, max_num_seqs=1, max_model_len=32, page_size=4).prompt_logprobs([ids])[0]


def test_fp8_layers_stay_fp8_and_equal_the_checkpoint(fp8_checkpoint):
    path, quantized = fp8_checkpoint
    model = _load(path)  # "auto": config.json declares fp8
    attn, layer1 = model.model.layers[0].self_attn, model.model.layers[1]
    assert isinstance(attn.q_a_proj, Fp8Linear) and isinstance(attn.o_proj, Fp8Linear)
    assert isinstance(model.model.layers[0].mlp.down_proj, Fp8Linear)
    assert isinstance(layer1.mlp.shared_experts.gate_proj, Fp8Linear)
    assert type(attn.kv_b_proj) is torch.nn.Linear and attn.kv_b_proj.weight.dtype == torch.float32
    experts = layer1.mlp.experts
    assert experts.gate_up_proj.dtype == FP8_DTYPE and experts.down_proj_scale_inv.shape == (4, 2, 1)
    sd, disk = model.state_dict(), load_file(path / SINGLE)
    for key in quantized:
        m = re.match(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", key)
        if m:  # stacked: gate rows then up rows; a scale row per 128 rows
            stacked, e, which = m.group(1), int(m.group(2)), m.group(3)
            name = "down_proj" if which == "down" else "gate_up_proj"
            rows = {"gate": slice(0, 128), "up": slice(128, 256), "down": slice(None)}[which]
            srows = {"gate": slice(0, 1), "up": slice(1, 2), "down": slice(None)}[which]
            got, got_scale = sd[f"{stacked}.{name}"][e, rows], sd[f"{stacked}.{name}_scale_inv"][e, srows]
        elif "kv_b_proj" in key:
            continue
        else:
            got, got_scale = sd[key], sd[key + "_scale_inv"]
        assert got.dtype == FP8_DTYPE, key
        assert torch.equal(got.view(torch.uint8), disk[key].view(torch.uint8)), key
        assert torch.equal(got_scale, disk[key + "_scale_inv"]), key


def test_fp8_weights_take_about_half_the_bytes_of_bf16(fp8_checkpoint):
    path, _ = fp8_checkpoint

    def nbytes(model, layers):  # the decoder layers: embeddings and head are not quantized
        return sum(t.numel() * t.element_size() for t in layers.state_dict().values())

    kept = _load(path, dtype=torch.bfloat16)
    bf16 = _load(path, dtype=torch.bfloat16, fp8_weights="dequantize")
    ratio = nbytes(kept, kept.model.layers) / nbytes(bf16, bf16.model.layers)
    # fp8 linears and experts: 1 byte + a float32 per 16K; kv_b_proj, router and norms stay wide
    assert 0.5 < ratio < 0.56, ratio


def test_fp8_logprobs_match_the_dequantized_model(fp8_checkpoint):
    """Kept fp8 (dequantized per call on CPU) computes what the dequantized-at-load model does,
    and both what transformers computes holding the dequantized weights (1e-4 in float32)."""
    path, _ = fp8_checkpoint
    kept, dequantized = _load(path), _load(path, fp8_weights="dequantize")
    assert not any(isinstance(m, Fp8Linear) for m in dequantized.modules())
    got = _logprobs(kept)
    torch.testing.assert_close(got, _logprobs(dequantized), atol=1e-5, rtol=0)
    hf = _hf_model()
    missing, unexpected = hf.load_state_dict(dequantized.state_dict(), strict=False)
    assert not unexpected and all("rotary" in k for k in missing)
    torch.testing.assert_close(got, hf_token_logprobs(hf, IDS), atol=1e-4, rtol=0)
    # bfloat16: the same weights, rounded the same way, whether at load or per call
    kept_bf16 = _logprobs(_load(path, dtype=torch.bfloat16))
    torch.testing.assert_close(kept_bf16, _logprobs(_load(path, dtype=torch.bfloat16, fp8_weights="dequantize")),
                               atol=0, rtol=0)


def test_keep_without_quantization_config(tmp_path):
    """fp8 tensors but no quantization_config: "auto" dequantizes (the old behaviour), "keep" keeps."""
    write_fp8_checkpoint(tmp_path, quantization_config=None)
    assert not any(isinstance(m, Fp8Linear) for m in _load(tmp_path).modules())
    assert isinstance(_load(tmp_path, fp8_weights="keep").model.layers[0].self_attn.q_a_proj, Fp8Linear)


def test_fp8_weights_errors(fp8_checkpoint, hf_checkpoint, tmp_path):
    path, _ = fp8_checkpoint
    with pytest.raises(ValueError, match=r"fp8_weights: expected one of \('auto', 'keep', 'dequantize'\), got 'yes'"):
        _load(path, fp8_weights="yes")
    with pytest.raises(ValueError, match="fp8_weights='keep': the checkpoint has no fp8 weights"):
        _load(hf_checkpoint("v3")[1], fp8_weights="keep")
    with pytest.raises(ValueError, match="runs in float32 or bfloat16, got dtype torch.float16"):
        _load(path, dtype=torch.float16)
    assert _load(path, dtype=torch.float16, fp8_weights="dequantize").dtype == torch.float16
    blocks = tmp_path / "blocks"
    write_fp8_checkpoint(blocks, quantization_config={**QUANT, "weight_block_size": [64, 64]})
    expected = r"weight_block_size \[128, 128\].*got fmt 'e4m3', weight_block_size \[64, 64\]"
    with pytest.raises(ValueError, match=expected):
        _load(blocks)


def test_fp8_experts_need_whole_blocks_of_gate_rows(tmp_path):
    write_fp8_checkpoint(tmp_path, moe_intermediate_size=64)
    expected = "moe_intermediate_size divisible by 128.*got 64; pass fp8_weights='dequantize'"
    with pytest.raises(ValueError, match=expected):
        _load(tmp_path)
    assert torch.isfinite(_logprobs(_load(tmp_path, fp8_weights="dequantize"))).all()


@pytest.mark.parametrize(
    "key", ["model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.experts.2.up_proj.weight"]
)
def test_fp8_weight_stored_wide_is_named(fp8_checkpoint, tmp_path, key):
    """A weight whose scale says fp8 but whose tensor is not e4m3 is reported (once), not cast."""
    path, _ = fp8_checkpoint
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    tensors = load_file(path / SINGLE)
    tensors[key] = tensors[key].float()
    save_file(tensors, tmp_path / SINGLE, metadata={"format": "pt"})
    with pytest.raises(ValueError) as e:
        _load(tmp_path)
    assert str(e.value).count(key) == 1 and f"{key}: expected dtype float8_e4m3fn" in str(e.value)
    assert "missing" not in str(e.value)


@pytest.mark.gpu
def test_fp8_model_on_cuda_matches_the_dequantized_model(fp8_checkpoint):
    """bf16 on CUDA: the fp8 GEMMs (q_a_proj, kv_a_proj_with_mqa, the 128-aligned MLP and expert
    weights; ragged ones dequantize per call) quantize activations per 1x128 group, so logprobs
    move: stated tolerance max 0.5, mean 0.1 nats against the dequantized bf16 model (whose own
    distance to float32 is printed for scale)."""
    path, _ = fp8_checkpoint
    kw = dict(dtype=torch.bfloat16, device="cuda")
    kept = _logprobs(_load(path, **kw)).float()
    dequantized = _logprobs(_load(path, fp8_weights="dequantize", **kw)).float()
    exact = _logprobs(_load(path, fp8_weights="dequantize"))
    diff = (kept.cpu() - dequantized.cpu()).abs()
    print(f"fp8 vs dequantized bf16: max {diff.max():.3f}, mean {diff.mean():.3f}; "
          f"bf16 vs float32: max {(dequantized.cpu() - exact).abs().max():.3f}")
    assert diff.max() < 0.5 and diff.mean() < 0.1


def test_fp8_model_compiles_without_graph_breaks(fp8_checkpoint):
    """The engine's compiled step (fullgraph, mlagraph's passes and lints) takes the fp8 ops."""
    path, _ = fp8_checkpoint
    model = _load(path)
    torch._dynamo.reset()
    try:
        engine = Engine(model, max_num_seqs=2, max_model_len=32, page_size=4, compile=True,
                        compile_backend="mlagraph_eager")
        got = engine.prompt_logprobs([IDS])[0]
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(got, _logprobs(model), atol=1e-5, rtol=0)
