"""The MTP layer: loaded from DeepSeek's checkpoint names, and computing what DeepSeek's layer
computes (a transformers decoder layer fed eh_proj(concat(enorm(embed), hnorm(h))) is the
oracle).

Tiny checkpoints: transformers writes the main model; the MTP layer ``model.layers.2.*`` is a
third transformers decoder layer's weights (so DeepSeek's names, experts one per file entry)
plus random ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and the copies of the
embedding and head DeepSeek stores there.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from mlagraph.model import DeepseekForCausalLM
from mlagraph.model.attention import KVCaches
from mlagraph.model.batch import build_batch
from mlagraph.model.mtp import mtp_step

from .conftest import INIT_STD, hf_config, make_hf_model

SINGLE = "model.safetensors"


def _hf_model(kind: str, seed: int, **overrides):
    """A transformers model of conftest's config with ``overrides`` (mlp_layer_types re-derived)."""
    base = hf_config(kind)
    d = {**base.to_dict(), **overrides}
    for key in ("mlp_layer_types", "layer_types"):
        d.pop(key, None)
    cfg = type(base)(**d)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    cls = transformers.DeepseekV32ForCausalLM if kind == "v32" else transformers.DeepseekV3ForCausalLM
    return cls(cfg).float().eval()


def _hf_layer_weights(kind: str, layers: int, seed: int) -> dict[str, torch.Tensor]:
    """A transformers model's weights with its experts split one per key, as DeepSeek stores them."""
    out = {}
    for k, v in _hf_model(kind, seed, num_hidden_layers=layers).state_dict().items():
        if "rotary_emb" in k:
            continue
        if k.endswith("experts.gate_up_proj"):  # [E, 2I, D]
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[k.replace("gate_up_proj", f"{e}.gate_proj.weight")] = v[e, :inter].clone()
                out[k.replace("gate_up_proj", f"{e}.up_proj.weight")] = v[e, inter:].clone()
        elif k.endswith("experts.down_proj"):  # [E, D, I]
            for e in range(v.shape[0]):
                out[k.replace("down_proj", f"{e}.down_proj.weight")] = v[e].clone()
        else:
            out[k] = v
    return out


def _mtp_tensors(kind: str, main: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """DeepSeek's MTP layer 2 for conftest's 2-layer models: a (MoE) decoder layer and the rest."""
    g = torch.Generator().manual_seed(5)
    third = _hf_layer_weights(kind, 3, seed=11)
    out = {k: v.clone() for k, v in third.items() if k.startswith("model.layers.2.")}
    D = main["model.embed_tokens.weight"].shape[1]
    for name in ("enorm", "hnorm", "shared_head.norm"):  # not ones: the test sees which norm goes where
        out[f"model.layers.2.{name}.weight"] = 1 + 0.3 * torch.randn(D, generator=g)
    out["model.layers.2.eh_proj.weight"] = INIT_STD * torch.randn(D, 2 * D, generator=g)
    out["model.layers.2.embed_tokens.weight"] = main["model.embed_tokens.weight"].clone()
    out["model.layers.2.shared_head.head.weight"] = main["lm_head.weight"].clone()
    return out


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    made = {}

    def get(kind: str):
        if kind not in made:
            hf = make_hf_model(kind)
            path = tmp_path_factory.mktemp(f"mtp_{kind}")
            hf.save_pretrained(path)
            tensors = load_file(path / SINGLE)
            mtp = _mtp_tensors(kind, tensors)
            save_file({**tensors, **mtp}, path / SINGLE, metadata={"format": "pt"})
            config = json.loads((path / "config.json").read_text())
            config["num_nextn_predict_layers"] = 1
            (path / "config.json").write_text(json.dumps(config))
            made[kind] = (path, mtp)
        return made[kind]

    return get


def _load(path):
    return DeepseekForCausalLM.from_pretrained(path, progress=False)


@pytest.mark.parametrize("kind", ["v3", "v32"])
def test_mtp_layer_loads_under_deepseek_names(mtp_checkpoint, kind):
    path, mtp = mtp_checkpoint(kind)
    model = _load(path)
    assert model.mtp is not None
    ours = model.state_dict()
    for key, value in mtp.items():
        rest = key.removeprefix("model.layers.2.")
        if rest.startswith(("embed_tokens.", "shared_head.head.")):
            continue  # the main model's are used
        if ".experts." in rest:
            continue  # stacked: checked below
        assert torch.equal(ours["mtp." + rest], value), rest
    I = model.config.moe_intermediate_size
    gate_up = ours["mtp.mlp.experts.gate_up_proj"]
    assert torch.equal(gate_up[3, :I], mtp["model.layers.2.mlp.experts.3.gate_proj.weight"])
    assert torch.equal(ours["mtp.mlp.experts.down_proj"][5], mtp["model.layers.2.mlp.experts.5.down_proj.weight"])
    assert (model.mtp.self_attn.indexer is not None) == (kind == "v32")


def test_checkpoint_without_mtp_weights_loads_without_the_layer(hf_checkpoint):
    """transformers' own save keeps num_nextn_predict_layers: 1 and drops the layer."""
    _, path = hf_checkpoint("v3")
    assert json.loads((path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert _load(path).mtp is None


def test_config_without_mtp_skips_its_weights(mtp_checkpoint, tmp_path):
    path, _ = mtp_checkpoint("v3")
    dst = tmp_path / "no_mtp"
    dst.mkdir()
    (dst / SINGLE).write_bytes((path / SINGLE).read_bytes())
    config = json.loads((path / "config.json").read_text())
    config["num_nextn_predict_layers"] = 0
    (dst / "config.json").write_text(json.dumps(config))
    assert _load(dst).mtp is None


def test_incomplete_mtp_layer_is_reported(mtp_checkpoint, tmp_path):
    path, _ = mtp_checkpoint("v3")
    dst = tmp_path / "partial"
    dst.mkdir()
    tensors = load_file(path / SINGLE)
    del tensors["model.layers.2.eh_proj.weight"], tensors["model.layers.2.self_attn.kv_b_proj.weight"]
    save_file(tensors, dst / SINGLE, metadata={"format": "pt"})
    (dst / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ValueError, match=r"2 missing weight\(s\):\n    mtp.eh_proj.weight\n    mtp.self_attn.kv_b_proj.weight"):
        _load(dst)


@pytest.mark.parametrize("kind", ["v3", "v32"])
@torch.no_grad()
def test_mtp_step_equals_deepseek_layer_oracle(mtp_checkpoint, kind):
    """mtp_step over a prompt (the main model's hidden states, tokens shifted by one) equals a
    one-layer transformers model holding the MTP decoder layer, fed eh_proj(concat(enorm(
    embed(t_{p+1})), hnorm(h_p))), with shared_head.norm as its final norm."""
    path, mtp = mtp_checkpoint(kind)
    model = _load(path)
    ids = torch.randint(0, model.config.vocab_size, (15,), generator=torch.Generator().manual_seed(2)).tolist()
    n, ps = len(ids) - 1, 4
    caps = model.backend.capabilities
    main = model.allocate_caches(8, ps)
    own = model.allocate_caches(8, ps, num_layers=1)
    caches = KVCaches(main.layout, main.latent + own.latent, main.scale, main.index_layout,
                      None if main.index is None else main.index + own.index)
    pages = [0, 1, 2, 3]
    dsa = dict(dsa=model.config.uses_dsa, dsa_dense_max_kv_len=model.config.index_topk)
    h = model.hidden_states(build_batch(caps, [ids[:n]], [0], [pages], ps, all_logits=True, **dsa), caches)
    batch = build_batch(caps, [ids[1:]], [0], [pages], ps, all_logits=True, **dsa)
    got = model.logits(mtp_step(model, batch, caches, h))  # [n, V]: predicting ids[2:] and one more

    oracle = _hf_model(kind, 0, num_hidden_layers=1, first_k_dense_replace=0)  # the MTP layer is a MoE layer
    layer = {k.replace("model.layers.2.", "model.layers.0."): v for k, v in mtp.items()
             if not k.split("model.layers.2.")[1].startswith(("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens"))}
    sd = {k: v for k, v in layer.items() if ".experts." not in k}
    E = model.config.n_routed_experts
    pre = "model.layers.0.mlp.experts."
    sd[pre + "gate_up_proj"] = torch.stack([torch.cat([layer[f"{pre}{e}.gate_proj.weight"],
                                                       layer[f"{pre}{e}.up_proj.weight"]]) for e in range(E)])
    sd[pre + "down_proj"] = torch.stack([layer[f"{pre}{e}.down_proj.weight"] for e in range(E)])
    sd["model.norm.weight"] = mtp["model.layers.2.shared_head.norm.weight"]
    sd["model.embed_tokens.weight"] = mtp["model.layers.2.embed_tokens.weight"]
    sd["lm_head.weight"] = mtp["model.layers.2.shared_head.head.weight"]
    missing, unexpected = oracle.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary_emb" in k or "e_score_correction_bias" in k for k in missing), missing
    oracle.model.layers[0].mlp.gate.e_score_correction_bias.copy_(mtp["model.layers.2.mlp.gate.e_score_correction_bias"])

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    e = rms(sd["model.embed_tokens.weight"][ids[1:]], mtp["model.layers.2.enorm.weight"])
    x = torch.cat([e, rms(h, mtp["model.layers.2.hnorm.weight"])], -1) @ mtp["model.layers.2.eh_proj.weight"].T
    want = oracle(inputs_embeds=x[None]).logits[0].float()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
