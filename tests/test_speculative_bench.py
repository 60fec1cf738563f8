"""benchmarks/speculative.py on CPU: a tiny run checks every variant against the base run and
writes its JSON and markdown (the real numbers come from the H200)."""

from __future__ import annotations

import json

from benchmarks import speculative as bench


def test_tiny_run_writes_checked_results(tmp_path):
    res = bench.main(["--out", str(tmp_path), "--device", "cpu", "--tiny", "--batches", "2", "--ks", "2",
                      "--new-tokens", "6", "--prompt-len", "5", "--layers", "1"])
    variants = {p["variant"]: p for p in res["points"]}
    assert set(variants) == {"base", "mtp_k2", "oracle_k2"}
    assert variants["oracle_k2"]["acceptance_rate"] == 1.0  # the upper bound: every draft kept
    assert variants["mtp_k2"]["acceptance_rate"] < 1.0  # random weights
    assert variants["mtp_k2"]["equal_to_base"] == "2/2" and variants["oracle_k2"]["equal_to_base"] == "2/2"
    assert json.loads((tmp_path / "speculative.json").read_text()) == res
    assert "| 2 | oracle_k2 | 1.000 |" in (tmp_path / "speculative.md").read_text()
