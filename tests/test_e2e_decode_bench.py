"""benchmarks/e2e_decode.py on CPU: the weight mapping onto transformers, the ablation backend,
and a tiny end-to-end run of the script (its JSON, merging and markdown).

The benchmark compares our engine's decode step with transformers' DeepseekV3ForCausalLM on the
same tensors; these tests prove both compute the same logits (float32, tiny config with V3's MLA
dims, weights at std 0.2 so a wrong RoPE layout or routing cannot hide under the tolerance).
"""

from __future__ import annotations

import json

import pytest
import torch

import mlagraph
from benchmarks import e2e_decode as bench
from mlagraph.model import Engine
from mlagraph.ops import backends

transformers = pytest.importorskip("transformers")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny():
    """(tiny HF config dict, our reference model in float32 with std-0.2 weights)."""
    cfg = bench.model_config(2, tiny=True)
    return cfg, bench.build_model(cfg, "reference", CPU, torch.float32, std=0.2)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_hf_matches_mlagraph_one_decode_step(tiny, attn):
    cfg, ours = tiny
    hf = bench.hf_model_like(ours, cfg, attn=attn)
    assert hf.lm_head.weight.data_ptr() == ours.lm_head.weight.data_ptr()  # shared, not copied
    experts = hf.model.layers[1].mlp.experts, ours.model.layers[1].mlp.experts
    assert experts[0].gate_up_proj.data_ptr() == experts[1].gate_up_proj.data_ptr()
    check = bench.hf_vs_mlagraph(ours, hf, batch=3, ctx=70)
    assert check["max_abs_logit"] > 1.0  # the logits are not all tiny: the tolerance below means something
    assert check["max_abs_diff"] < 1e-4, check
    assert check["argmax_agree"] == 1.0


def test_shared_model_and_mapping_errors(tiny):
    cfg, ours = tiny
    other = bench.build_model(cfg, "reference", CPU, torch.float32, like=ours)
    for (name, a), b in zip(ours.state_dict().items(), other.state_dict().values()):
        assert a.data_ptr() == b.data_ptr(), name
    assert other.rope_cos_sin is ours.rope_cos_sin
    with torch.device("meta"):
        hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**cfg, "n_routed_experts": 4}))
    expected = r"mlp\.experts\.gate_up_proj: ours \[8, 128, 256\], transformers \[4, 128, 256\]"
    with pytest.raises(ValueError, match=expected):
        bench.hf_state_dict(ours, hf)


def test_ref_decode_backend_compiles_and_passes_lints(tiny):
    """The ablation backend: triton's ops but the reference decode; the passes still fuse and
    eliminate the concat, the lints accept the graph, the logits equal the reference model's."""
    cfg, ours = tiny
    before = backends.names()
    added = backends.register(bench.ref_decode_backend(backends.get("triton")))
    try:
        assert added.owned_ops() == frozenset()
        model = bench.build_model(cfg, added.name, CPU, torch.float32, like=ours)
        engines = [Engine(ours, max_num_seqs=2, max_model_len=96, page_size=64),
                   Engine(model, max_num_seqs=2, max_model_len=96, page_size=64, compile=True,
                          compile_backend="mlagraph_eager")]
        logits = []
        for engine in engines:
            bench.fill_latents(engine, seed=0)
            reqs = bench.decode_requests(engine, 2, 70, seed=1)
            logits.append(bench.engine_step(engine, reqs, 70)[1])
            bench.release(engine, reqs)
        torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=0)
        counts = {(r.pass_name, r.layer): r.count for r in mlagraph.passes.last_report()}
        assert counts == {(p, layer): 1 for p in ("fuse_rope_concat_cache", "eliminate_concat") for layer in (0, 1)}
        assert "mlagraph.mla_decode(" in mlagraph.passes.last_compile().after
    finally:
        backends.unregister(added.name)
    assert backends.names() == before


def test_cli_tiny_run_writes_and_merges(tmp_path):
    common = ["--out", str(tmp_path), "--tiny", "--device", "cpu", "--backend", "reference", "--batches", "1,2",
              "--contexts", "16,32", "--iters", "2"]
    bench.main([*common, "--only", "hf_eager,hf_sdpa,eager"])
    data = json.loads((tmp_path / "e2e_decode.json").read_text())
    assert data["hf_check"]["max_abs_diff"] < 1e-4 and data["hf_check"]["argmax_agree"] == 1.0
    points = {(b, c) for b in (1, 2) for c in (16, 32)}
    for variant in ("hf_eager", "hf_sdpa", "eager"):
        rows = [r for r in data["rows"] if r["variant"] == variant]
        assert {(r["batch"], r["context"]) for r in rows} == points
        assert all(r["ms"] > 0 and "error" not in r for r in rows), rows
    assert data["variants"]["hf_eager"]["experts_implementation"]

    # a second run adds to the same file; graph variants are skipped on CPU, with the reason
    bench.main([*common, "--only", "full,no_graphs", "--batches", "2", "--contexts", "16"])
    data = json.loads((tmp_path / "e2e_decode.json").read_text())
    assert len(data["runs"]) == 2
    assert "CUDA graphs need a CUDA device" in data["variants"]["full"]["skipped"]
    assert {r["variant"] for r in data["rows"]} == {"hf_eager", "hf_sdpa", "eager", "no_graphs"}
    md = (tmp_path / "e2e_decode.md").read_text()
    assert "| B | ctx | hf (best) | mlagraph eager |" in md and "| 2 | 32 |" in md
    assert "| - fusion | - concat elimination | - our decode kernel | - CUDA graphs |" in md

    with pytest.raises(ValueError, match="another config"):  # other numbers would be mixed in
        bench.main([*common, "--only", "eager", "--layers", "1"])


def test_backend_table_has_a_column_per_backend_that_ran(tmp_path):
    meta = dict(config={}, dtype="bfloat16", device="GPU", backend="triton", date="today", argv=[], torch="2",
                triton="3", transformers="5", iters=5, layers=2)
    res = bench.Results(str(tmp_path), meta)
    for variant, ms in [("full", 2.0), ("flashmla", 1.0), ("auto", 1.5)]:
        res.add(dict(variant=variant, batch=32, context=1024, ms=ms))
    res.add(dict(variant="flashinfer", batch=32, context=1024, error="out of memory"))
    md = bench.tables(res)
    assert "| B | ctx | triton | flashmla | flashinfer | auto |" in md  # aiter never ran: no column
    assert "| 32 | 1024 | 2.00 | 1.00 (0.50x) | OOM | 1.50 (0.75x) |" in md
