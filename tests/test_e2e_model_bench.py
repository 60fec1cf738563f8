"""benchmarks/e2e_model.py in its --smoke mode on CPU: the checkpoint it writes is a real HF
checkpoint (both loaders read it, to the same weights), every part runs and lands in the JSON
and the tables, and the memory floor counts what a decode step must read."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import e2e_model as bench
from mlagraph.model import DeepseekForCausalLM

pytest.importorskip("transformers")

SMOKE = ["--smoke", "--device", "cpu", "--backend", "reference", "--prompts", "16,32", "--batches", "1,2",
         "--context", "16", "--tokens", "1,4", "--iters", "1"]


def test_smoke_run_writes_every_part(tmp_path):
    data = bench.main(["--out", str(tmp_path), *SMOKE])
    assert data["checkpoint"]["reused"] is False and data["checkpoint"]["shards"] == 1
    assert data["check"]["max_abs_diff"] < 1e-4  # float32: both models compute the same logprobs
    rows = json.loads((tmp_path / "e2e_model.json").read_text())["rows"]
    for part in ("ours", "hf"):
        assert sorted(r["tokens"] for r in rows if r["part"] == part and r["kind"] == "prefill") == [16, 32]
        decode = [r for r in rows if r["part"] == part and r["kind"] == "decode"]
        assert sorted(r["batch"] for r in decode) == [1, 2] and all(r["ms"] > 0 and r["tok_s"] > 0 for r in decode)
    assert all(r["floor_ms"] > 0 for r in rows if r["part"] == "ours" and r["kind"] == "decode")
    layer = [r for r in rows if r["part"] == "v3_layer"]
    assert sorted((r["experts"], r["tokens"]) for r in layer) == [("bf16", 1), ("bf16", 4), ("fp8", 1), ("fp8", 4)]
    assert all(r["rel_err"] < 1e-2 and r["ms"] > 0 and 1 <= r["touched_experts"] <= 16 for r in layer), layer
    md = (tmp_path / "e2e_model.md").read_text()
    assert "| prefill tokens | mlagraph tok/s | transformers tok/s | speedup |" in md
    assert "| 2 | " in md and "| 4 | fp8 |" in md

    # the checkpoint is kept and reused while the config matches; a run of one part keeps the others' rows
    again = bench.main(["--out", str(tmp_path), *SMOKE, "--only", "ours"])
    assert again["checkpoint"] == {"reused": True}
    merged = json.loads((tmp_path / "e2e_model.json").read_text())
    assert sorted(r["part"] for r in merged["rows"]) == sorted(r["part"] for r in rows)
    assert merged["check"] == data["check"]


def test_checkpoint_holds_the_model_it_was_written_from(tmp_path):
    config = bench.hf_config_dict(smoke=True)
    bench.write_checkpoint(str(tmp_path), config, torch.device("cpu"), torch.float32)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in index  # per-expert, as DeepSeek's are
    loaded = DeepseekForCausalLM.from_pretrained(tmp_path, progress=False).state_dict()
    written = DeepseekForCausalLM.from_config(config, init_std=0.02).state_dict()
    assert loaded.keys() == written.keys()
    assert all(torch.equal(loaded[k], written[k]) for k in loaded)


def test_decode_floor_counts_touched_experts_and_cache():
    model = DeepseekForCausalLM.from_config(bench.hf_config_dict(smoke=True))
    c = model.config
    sd = model.state_dict()
    experts = sum(t.numel() * 4 for k, t in sd.items() if "mlp.experts." in k)
    others = sum(t.numel() * 4 for k, t in sd.items() if "mlp.experts." not in k and "embed_tokens" not in k)
    cache_row = c.num_hidden_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * 2
    one = bench.decode_floor_ms(model, 1, 100) * bench.PEAK_BYTES / 1e3
    share = c.num_experts_per_tok / c.n_routed_experts  # batch 1 touches top_k of E experts
    assert one == pytest.approx(others + share * experts + c.hidden_size * 4 + 100 * cache_row)
    many = bench.decode_floor_ms(model, 512, 100) * bench.PEAK_BYTES / 1e3
    assert many == pytest.approx(others + experts + 512 * (c.hidden_size * 4 + 100 * cache_row))


def test_moe_sort_torch_runs_the_old_sorted_path(tmp_path, monkeypatch):
    """--moe-sort torch swaps the triton backend's sorted MoE path for the torch-sorted one (the
    A/B of the one-launch sort end to end); the run says so in its JSON and table."""
    import mlagraph.ops.triton.moe as triton_moe

    monkeypatch.setattr(triton_moe, "grouped_triton", triton_moe.grouped_triton)  # restored after the test
    monkeypatch.setattr(triton_moe, "sorted_generic", triton_moe.sorted_generic)
    args = ["--smoke", "--device", "cpu", "--backend", "reference", "--prompts", "16", "--batches", "1",
            "--context", "16", "--iters", "1", "--only", "ours", "--moe-sort", "torch"]
    data = bench.main(["--out", str(tmp_path), *args])
    # the script imports benchmarks/common.py as ``common``: another module object than ours
    assert triton_moe.grouped_triton.__name__ == "torch_sorted_experts" and data["moe_sort"] == "torch"
    assert triton_moe.sorted_generic.__name__ == "torch_sorted_generic"
    assert "MoE sorted by torch" in (tmp_path / "e2e_model.md").read_text()
