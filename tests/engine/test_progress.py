"""Progress lines while compiling: once per new plan variant, quiet unless asked or on a terminal."""

from __future__ import annotations

import io
import random

import pytest

from mlagraph.engine import Engine
from mlagraph.engine.progress import CompileProgress, enabled
from mlagraph.model import DeepseekForCausalLM
from tests.model.conftest import VOCAB, hf_config


def test_once_per_variant(capsys):
    progress = CompileProgress(True)
    for key in ["a", "a", "b"]:
        with progress.step(key, f"variant {key}"):
            pass
    err = capsys.readouterr().err
    assert err.count("compiling the variant a step") == 1 and err.count("compiling the variant b step") == 1
    assert "compiled the variant b step" in err


def test_quiet_off_a_terminal(monkeypatch, capsys):
    monkeypatch.setattr("sys.stderr", io.StringIO())
    assert not enabled(None) and enabled(True) and not enabled(False)
    progress = CompileProgress(None)
    with progress.step("a", "x"):
        pass
    assert progress.seen == {"a"}
    assert "compil" not in capsys.readouterr().err


@pytest.mark.slow
def test_compiled_engine_says_what_it_compiles(capsys):
    model = DeepseekForCausalLM.from_config(hf_config("v3"))
    engine = Engine(model, max_num_seqs=2, max_model_len=32, page_size=4, compile=True,
                    compile_backend="mlagraph_eager", progress=True)
    rnd = random.Random(0)
    engine.generate([[rnd.randrange(VOCAB) for _ in range(5)] for _ in range(2)], max_new_tokens=3)
    err = capsys.readouterr().err
    assert "compiled the prefill (mha) step" in err and "compiled the decode (absorbed) step" in err
    engine.generate([[1, 2, 3]], max_new_tokens=2)
    assert "compil" not in capsys.readouterr().err  # nothing new to compile
