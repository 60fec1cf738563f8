"""benchmarks/dsa_prefill.py on CPU: the tiny run (the triton backend through Triton's
interpreter, which tests/conftest.py turns on) writes one checked row per (backend, prefix, N);
a backend the machine lacks is skipped with its reason; a bad argument or a failed check
stops the run with a clear message."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import dsa_prefill as bench

TINY = ["--device", "cpu", "--tiny"]


def test_tiny_run_writes_every_row_checked(tmp_path, capsys):
    bench.main([*TINY, "--out", str(tmp_path)])
    data = json.loads((tmp_path / "dsa_prefill.json").read_text())
    rows, topk = data["rows"], data["index_topk"]
    assert data["default_dense_limit"] == topk == 8 and data["skipped_backends"] == {}
    assert [(r["backend"], r["prefix"], r["tokens"]) for r in rows] == [
        (b, p, n) for p in (0, 4) for n in (4, 12) for b in ("reference", "triton")]
    for r in rows:
        exact = r["kv_len"] <= topk
        assert r["note"] == "" and r["dense_ms"] > 0 and r["sparse_ms"] > 0, r
        assert r["ttft_dense_vs_sparse_pct"] == pytest.approx((r["dense_ms"] / r["sparse_ms"] - 1) * 100)
        assert r["default_plan"] == ("dense" if exact else "sparse")
        # sparse = dense where dense is exact; triton against the reference on the same caches
        want = ["sparse=dense"] * exact + ["dense=reference", "sparse=reference"] * (r["backend"] == "triton")
        assert r["checked"] == want, r
        assert all(r["checks"][c]["rel_err"] <= r["checks"][c]["tol"] == 1e-4 for c in want)
        # past index_topk the two paths differ for real (the checks above could fail)
        assert (r["dense_vs_sparse_rel_diff"] < 1e-5) if exact else (r["dense_vs_sparse_rel_diff"] > 1e-2)
    md = (tmp_path / "dsa_prefill.md").read_text()
    assert "| triton | 4 | 12 | 16 | sparse |" in md and "MI355X reference (measured elsewhere" in md
    out = capsys.readouterr().out.rstrip().splitlines()
    assert out[-1].startswith("| triton | 4 | 12 | 16 | sparse |")  # the table comes last
    assert any(line.startswith("Note: MI355X reference (measured elsewhere, not by this script)") for line in out)


def test_unavailable_backend_is_skipped_with_its_reason(tmp_path):
    data = bench.main([*TINY, "--backends", "reference", "flashmla", "--lengths", "4", "--prefixes", "0",
                       "--out", str(tmp_path)])
    assert "flashmla" in data["skipped_backends"] and "is not available" in data["skipped_backends"]["flashmla"]
    assert [r["backend"] for r in data["rows"]] == ["reference"]
    assert "Skipped backend flashmla: backend 'flashmla' is not available" in (tmp_path / "dsa_prefill.md").read_text()


def test_failed_check_stops_the_run(tmp_path, monkeypatch):
    monkeypatch.setitem(bench.TOL, torch.float32, 0.0)  # float32 rounding of two paths: never exactly 0
    with pytest.raises(bench.CheckFailed, match=r"reference, prefix 0, N 4: sparse=dense: .* relative L2 error "
                                                r"[0-9.e-]+ \(max abs difference .*\); tolerance 0"):
        bench.main([*TINY, "--backends", "reference", "--lengths", "4", "--prefixes", "0", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "dsa_prefill.json").read_text())
    assert "sparse=dense" in data["failed_check"] and data["rows"] == []


@pytest.mark.parametrize("argv, message", [
    (["--lengths", "4", "-8"], "--lengths: expected new-token counts >= 1, got [4, -8]"),
    (["--lengths", "0"], "--lengths: expected new-token counts >= 1"),
    (["--prefixes", "-4"], "--prefixes: expected cached prefix lengths >= 0, got [-4]"),
    (["--backends", "reference", "cuda"], "--backends: unknown 'cuda'; known backends: reference, triton"),
    (["--backends", "triton", "triton"], "--backends: each at most once"),
    (["--layers", "0"], "--layers: expected an int >= 1, got 0"),
    (["--device", "tpu"], "--device: expected cpu, cuda or cuda:<i>, got 'tpu'"),
    (["--lengths", "2000"], "exceeds the model's 1024 positions"),
])
def test_bad_argument_fails_with_a_clear_message(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main([*TINY, *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
