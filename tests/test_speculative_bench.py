"""benchmarks/speculative.py on CPU: a tiny run checks every variant against the base run and
writes its JSON and markdown (the real numbers come from the H200)."""

from __future__ import annotations

import json

import pytest

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


def test_tie_gap_scores_both_tokens_where_a_request_parts():
    """bf16's check: at the first differing token the base model must score the two tokens alike."""
    import torch

    class Scorer:  # log p(last token) = -token / 10, after checking the context is the common prefix
        def prompt_logprobs(self, prompts):
            assert len(prompts) == 2  # the two tokens scored in one call
            for ctx in prompts:
                assert ctx[:-1] == [7, 8, 1, 2]  # prompt + base tokens before the parting
            return [torch.tensor([0.0] * (len(ctx) - 2) + [-ctx[-1] / 10]) for ctx in prompts]

    prompts, base = [[7, 8], [9]], [[1, 2, 3, 4], [5, 6]]
    got = [[1, 2, 5, 4], [5, 6]]  # the first request parts at index 2 (5 instead of 3); the second is equal
    parts = [2, 2]
    assert abs(bench.tie_gap(Scorer(), prompts, got, base, parts) - 0.2) < 1e-6
    assert bench.tie_gap(Scorer(), prompts, base, base, [4, 2]) == 0.0


def test_float32_check_fails_an_engine_that_parts_from_base():
    """The check that gates timing: one changed token in one request of a variant is an error."""
    from mlagraph.model import DeepseekForCausalLM

    model = DeepseekForCausalLM.from_config(bench.model_config(1, tiny=True), init_std=0.2)
    common = dict(max_num_seqs=2, max_model_len=24, page_size=4, cuda_graphs=False, progress=False)
    engines = bench._engines(model, [1], common)
    prompts = [[1, 2, 3], [4, 5]]
    bench.check(engines, [1], prompts, 4, 2)  # the real engines agree

    spec = engines["mtp_k1"]
    real = spec.generate

    def one_token_off(*args, **kwargs):
        outs = real(*args, **kwargs)
        outs[1].token_ids[2] = (outs[1].token_ids[2] + 1) % 256
        return outs

    spec.generate = one_token_off
    with pytest.raises(RuntimeError, match=r"mtp_k1 at batch 2: 1 of 2 requests equal .*\(request 1 parts at token 2"):
        bench.check(engines, [1], prompts, 4, 2)


def test_a_float32_run_is_its_own_check(monkeypatch, tmp_path):
    """On CPU (float32) the timed runs' warm-ups are compared exactly: a parted request stops the run."""
    real = bench._compare

    def parted(engines, prompts, got, base):
        same, parts, gap = real(engines, prompts, got, base)
        return same - 1, [1] + parts[1:], gap

    monkeypatch.setattr(bench, "_compare", parted)
    with pytest.raises(RuntimeError, match=r"mtp_k1 at batch 2: 1 of 2 requests equal .*\(request 0 parts at token 1"):
        bench.main(["--out", str(tmp_path), "--device", "cpu", "--tiny", "--batches", "2", "--ks", "1",
                    "--new-tokens", "4", "--prompt-len", "3", "--layers", "1"])
