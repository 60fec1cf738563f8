"""examples/generate.py rejects bad flags up front, naming the flag (before building a model)."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "generate.py")


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("example_generate", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num-prompts", "0"], "--num-prompts: expected a positive number of prompts, got 0"),
        (["--max-new-tokens", "0"], "--max-new-tokens: expected a positive number of tokens, got 0"),
        (["--prompt-len", "-3"], "--prompt-len: expected a positive number of tokens, got -3"),
        (["--chunk", "0"], "--chunk: expected a positive prefill chunk size, got 0"),
        (["--tp", "2"], "--tp: expected the number of torchrun ranks (1;"),
    ],
)
def test_bad_flags_are_named(example, monkeypatch, capsys, flags, message):
    monkeypatch.setattr(sys, "argv", ["generate.py", *flags])
    with pytest.raises(SystemExit) as e:
        example.main()
    assert e.value.code == 2
    out = capsys.readouterr()
    assert message in out.err
    assert "model:" not in out.out  # nothing was built


def test_prompt_needs_a_checkpoint_with_a_tokenizer(example, monkeypatch, capsys, tmp_path):
    for flags in (["--prompt", "hi"], ["--prompt", "hi", "--model", str(tmp_path)]):
        monkeypatch.setattr(sys, "argv", ["generate.py", *flags])
        with pytest.raises(SystemExit):
            example.main()
        assert "--prompt: expected --model DIR with a tokenizer.json" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["generate.py", "--chat"])
    with pytest.raises(SystemExit):
        example.main()
    assert "--chat: expected --prompt TEXT" in capsys.readouterr().err


def test_text_prompt_prints_text_and_labelled_finish_reason(example, monkeypatch, capsys, hf_checkpoint, tmp_path):
    import shutil

    from tests.model.tiny_tokenizer import write_tokenizer

    _, path = hf_checkpoint("v3")
    ckpt = shutil.copytree(path, tmp_path / "ckpt")
    write_tokenizer(ckpt)
    monkeypatch.setattr(sys, "argv", ["generate.py", "--model", str(ckpt), "--prompt", "hello the cat", "--chat",
                                      "--no-compile", "--max-new-tokens", "3", "--ignore-eos"])
    example.main()
    out = capsys.readouterr().out
    assert "[0] prompt   6 tok -> '" in out and "finish_reason=length" in out


def test_torchrun_tp2_generates_the_tokens_of_one_rank():
    """`torchrun --nproc-per-node 2 examples/generate.py --tp 2` (gloo on CPU) prints the tokens
    the single-process run prints, once (rank 0)."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    flags = ["--no-compile", "--max-new-tokens", "3", "--num-prompts", "2"]

    def tokens(cmd, extra=()):
        out = subprocess.run([*cmd, EXAMPLE, *flags, *extra], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return [line for line in out.stdout.splitlines() if line.startswith("[")], out.stdout

    one, _ = tokens([sys.executable])
    two, stdout = tokens([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"], ["--tp", "2"])
    assert len(one) == 2 and one == two, (one, two)
    assert "tensor parallel x2" in stdout
