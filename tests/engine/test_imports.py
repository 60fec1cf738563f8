"""The engine is importable from both homes, whichever is imported first (the packages import
each other: mlagraph.model resolves Engine lazily)."""

from __future__ import annotations

import subprocess
import sys


def test_engine_importable_first_from_either_package():
    code = (
        "from mlagraph.engine import Engine as A, GenerationOutput as G1\n"
        "from mlagraph.model import Engine as B, GenerationOutput as G2, DeepseekForCausalLM\n"
        "assert A is B and G1 is G2\n"
    )
    reverse = "from mlagraph.model import Engine as B\nfrom mlagraph.engine import Engine as A\nassert A is B\n"
    for src in (code, reverse):
        run = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr


def test_unknown_model_attribute_is_an_attribute_error():
    import mlagraph.model

    try:
        mlagraph.model.Nope  # noqa: B018
    except AttributeError as e:
        assert "has no attribute 'Nope'" in str(e)
    else:
        raise AssertionError("expected AttributeError")
