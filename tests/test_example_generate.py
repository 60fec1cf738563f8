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
