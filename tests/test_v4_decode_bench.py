"""benchmarks/v4_decode.py on CPU: a tiny run of the whole script (every eager variant checked
against the reference, both CSA plans, its JSON and markdown)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import v4_decode as bench


@pytest.mark.slow
def test_tiny_run_writes_checked_rows(tmp_path):
    # dense limit 4·2 + 1 = 9: ctx 6 plans dense, ctx 20 sparse
    bench.main(["--tiny", "--device", "cpu", "--batches", "3", "--contexts", "6,20", "--page-size", "8",
                "--modes", "eager,compiled,graphs", "--iters", "1", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "v4_decode.json").read_text())
    steps = data["steps"]
    assert len(steps) == 2 * 3 * 3  # ctx 6 also with the sparse plan forced
    eager = [r for r in steps if r["variant"].endswith("/eager")]
    assert {(r["context"], r["plan"]) for r in eager} == {(6, "dense"), (6, "sparse (forced)"), (20, "sparse")}
    for r in eager:  # triton's decode kernels (interpreted) agree with the reference, and the
        assert r["time_us"] > 0 and r["error"] < 1e-4, r  # forced sparse plan with the dense one
    assert all(r["time_us"] is None and r["note"].startswith("skipped") for r in steps if r not in eager)
    md = (tmp_path / "v4_decode.md").read_text()
    assert "| 3 | 20 | sparse | triton/eager |" in md


def test_bf16_rows_are_also_checked_against_a_float32_copy(tmp_path, monkeypatch):
    """bf16: every row carries its error against the float32 reference model; with the plain
    tolerance at 0 a row still passes when it is as close to float32 as the bf16 reference."""
    monkeypatch.setattr(bench, "TOL", 0.0)
    bench.main(["--tiny", "--dtype", "bfloat16", "--device", "cpu", "--batches", "3", "--contexts", "20",
                "--page-size", "8", "--modes", "eager", "--iters", "1", "--no-kernels", "--out", str(tmp_path)])
    steps = {r["variant"]: r for r in json.loads((tmp_path / "v4_decode.json").read_text())["steps"]}
    ref, tri = steps["reference/eager"], steps["triton/eager"]
    assert 0 < ref["error_fp32"] < 2e-2 and 0 < tri["error_fp32"] < 2e-2  # bf16 rounding, not a bug
    assert tri["time_us"] > 0 and tri["note"].startswith("vs float32 within 2x"), tri
    assert ref["note"] == "" and ref["error"] == 0.0  # the bf16 reference is the plain check's own yardstick
    assert "| vs float32 |" in (tmp_path / "v4_decode.md").read_text()


@pytest.mark.parametrize("dims", [(8, 2, True, torch.float32), (8, 4, False, torch.float32)])
@pytest.mark.parametrize("tokens,ctx", [(1, 7), (9, 0)])
def test_compressor_rows_inputs_agree_between_triton_and_reference(dims, tokens, ctx):
    """The kernel rows' compressor case (decode with windows closing at ctx + 1, and a prefill)
    gives the same entries through the triton kernel (interpreted) and the reference op."""
    args, comp, nbytes = bench.compressor_case("csa", 3, tokens, ctx, "cpu", page_size=4, dims=dims)
    torch.ops.mlagraph.compressor_update(*args)
    want = comp.clone()
    assert want.abs().sum() > 0 and nbytes > 0
    comp.zero_()
    torch.ops.mlagraph_triton.compressor_update(*args)
    torch.testing.assert_close(comp, want, atol=1e-5, rtol=1e-5)
