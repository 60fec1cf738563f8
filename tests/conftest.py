"""Fixtures shared by every test package (the transformers oracle checkpoints live in
tests/model/conftest.py; the compile tests use them too)."""

import os

from tests.model.conftest import hf_checkpoint  # noqa: F401  (re-exported fixture)


def pytest_configure(config):
    # The CPU suite runs the triton backend's kernels through Triton's interpreter, which Triton
    # enables for kernels defined while TRITON_INTERPRET=1 is set. mlagraph imports its kernel
    # modules on first use, so setting it here (before any test runs) is early enough. A GPU
    # run (`pytest -m gpu`) compiles the kernels for the device instead.
    markexpr = config.getoption("markexpr") or ""
    if "gpu" not in markexpr.replace("not gpu", ""):
        os.environ.setdefault("TRITON_INTERPRET", "1")
