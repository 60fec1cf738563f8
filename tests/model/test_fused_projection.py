"""The attention layer's two projections of x run as one GEMM (MLAttention.fuse_input_projections).

q_proj (q_a_proj with a q LoRA) and kv_a_proj_with_mqa read the same hidden states, so a model
whose weights are final stacks them: one launch a layer instead of two, which is most of what
a batch-1 decode step pays for them. The fused model must compute what the unfused one does,
keep the checkpoint's parameter names and one copy of the weights (through ``.to()`` too), and
see in-place weight updates.
"""

from __future__ import annotations

import pytest
import torch

from mlagraph.model import DeepseekForCausalLM
from mlagraph.model.attention import MLAttention
from mlagraph.model.batch import build_batch

from .conftest import hf_config

PAGE = 4


def _model(kind: str, **dims) -> DeepseekForCausalLM:
    cfg = hf_config(kind).to_dict() | {"num_hidden_layers": 2, **dims}
    return DeepseekForCausalLM.from_config(cfg, init_std=0.2, backend="reference")


def _attentions(model) -> list[MLAttention]:
    return [m for m in model.modules() if isinstance(m, MLAttention)]


def _unfused_twin(model: DeepseekForCausalLM, kind: str, **dims) -> DeepseekForCausalLM:
    """A model of the same weights whose attention layers run the two projections apart."""
    twin = _model(kind, **dims)
    for a in _attentions(twin):
        a.fused_input_weight = None
    twin.load_state_dict(model.state_dict())
    return twin


@torch.no_grad()
def _logits(model) -> torch.Tensor:
    """A prefill of two prompts (all positions' logits), then one decode token each: [9, V]."""
    caps, caches = model.backend.capabilities, model.allocate_caches(16, PAGE)
    pages = [[0, 1, 2], [3, 4, 5]]
    prompts = [[5, 9, 2, 7, 1], [3, 8]]
    first = model(build_batch(caps, prompts, [0, 0], pages, PAGE, all_logits=True, dsa=model.config.uses_dsa), caches)
    second = model(build_batch(caps, [[4], [6]], [5, 2], pages, PAGE, is_decode=[True, True],
                               dsa=model.config.uses_dsa), caches)
    return torch.cat([first, second])


@pytest.mark.parametrize("kind", ["v2", "v3", "v32"])
def test_fused_model_equals_unfused(kind):
    fused = _model(kind)
    assert all(a.fused_input_weight is not None for a in _attentions(fused))
    plain = _unfused_twin(fused, kind)
    torch.testing.assert_close(_logits(fused), _logits(plain), rtol=1e-5, atol=1e-5)


def test_weights_are_views_of_the_stacked_tensor_and_keep_their_names():
    model = _model("v3")
    attn = _attentions(model)[0]
    stacked, first, kv_a = attn.fused_input_weight, attn.q_input_proj, attn.kv_a_proj_with_mqa
    assert stacked.shape == (first.out_features + kv_a.out_features, first.in_features)
    assert first.weight.data_ptr() == stacked.data_ptr()
    assert kv_a.weight.data_ptr() == stacked[first.out_features :].data_ptr()
    names = set(model.state_dict())
    assert not any("fused_input_weight" in n for n in names)
    assert "model.layers.0.self_attn.q_a_proj.weight" in names
    assert attn.fuse_input_projections()  # fused again: a view of the same rows, no copy
    assert attn.fused_input_weight.data_ptr() == stacked.data_ptr() == first.weight.data_ptr()


def test_a_model_built_on_fused_weights_shares_them():
    """Benchmarks build a second model on the first one's tensors (load_state_dict(assign=True))
    to hold a deep stack once; fusing must not copy them apart."""
    base = _model("v2")
    other = _model("v2")
    other.load_state_dict(base.state_dict(), assign=True)
    other.to_device_dtype("cpu", torch.float32)
    for (name, a), b in zip(base.state_dict().items(), other.state_dict().values()):
        assert a.data_ptr() == b.data_ptr(), name
    assert _attentions(other)[0].fused_input_weight.data_ptr() == _attentions(base)[0].fused_input_weight.data_ptr()


def test_to_restacks_instead_of_copying_twice():
    model = _model("v2")
    attn = _attentions(model)[0]
    before = torch.cat([attn.q_input_proj.weight, attn.kv_a_proj_with_mqa.weight]).double()
    model.to(torch.float64)
    stacked = attn.fused_input_weight
    assert stacked.dtype == torch.float64
    assert attn.q_input_proj.weight.data_ptr() == stacked.data_ptr()
    assert attn.kv_a_proj_with_mqa.weight.data_ptr() == stacked[attn.q_input_proj.out_features :].data_ptr()
    torch.testing.assert_close(stacked, before, rtol=0, atol=0)


def test_in_place_weight_update_reaches_the_fused_gemm():
    model = _model("v2")
    reference = _unfused_twin(model, "v2")
    with torch.no_grad():
        for m in (model, reference):
            m.model.layers[1].self_attn.kv_a_proj_with_mqa.weight.mul_(-0.5)
    torch.testing.assert_close(_logits(model), _logits(reference), rtol=1e-5, atol=1e-5)


def test_biased_projections_stay_apart():
    model = _model("v3", attention_bias=True)
    attn = _attentions(model)[0]
    assert attn.fused_input_weight is None
    assert attn.fuse_input_projections() is False
