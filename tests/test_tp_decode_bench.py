"""benchmarks/tp_decode.py on CPU: two gloo ranks under torch.distributed.run and one plain
process into one folder (tiny dims, an fp8 checkpoint written by rank 0): the two-rank model's
logprobs equal one rank's, every (batch, context) row is written, and the table gives each
world size's scaling against one rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["benchmarks/tp_decode.py", "--tiny", "--device", "cpu", "--batches", "2,3", "--contexts", "40", "--iters", "2"]


def _run(cmd, out):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, *cmd, *ARGS, "--out", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_two_ranks_then_one_fill_the_scaling_table(tmp_path):
    _run(["-m", "torch.distributed.run", "--nproc-per-node", "2"], tmp_path)
    two = json.loads((tmp_path / "tp2.json").read_text())
    assert two["world"] == 2 and two["fp8"] and two["logprob_max_abs_diff_vs_one_rank"] < 1e-4
    assert [(r["batch"], r["context"]) for r in two["rows"]] == [(2, 40), (3, 40)]
    assert all(r["ms"] > 0 and r["tok_s"] > 0 for r in two["rows"])
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"
    out = _run([], tmp_path)  # one rank, the same checkpoint (reused)
    lines = [line for line in out.splitlines() if line.startswith("| 2 | 3 | 40 |")]
    one = {(r["batch"], r["context"]): r["ms"] for r in json.loads((tmp_path / "tp1.json").read_text())["rows"]}
    row = {(r["batch"], r["context"]): r["ms"] for r in two["rows"]}
    assert len(lines) == 1 and f"{one[(3, 40)] / row[(3, 40)]:.2f}x" in lines[0], out
