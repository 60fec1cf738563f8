"""Fixtures shared by every test package (the transformers oracle checkpoints live in
tests/model/conftest.py; the compile tests use them too)."""

import fcntl
import os
import tempfile

import pytest

from tests.model.conftest import hf_checkpoint  # noqa: F401  (re-exported fixture)


def pytest_configure(config):
    # The CPU suite runs the triton backend's kernels through Triton's interpreter, which Triton
    # enables for kernels defined while TRITON_INTERPRET=1 is set. mlagraph imports its kernel
    # modules on first use, so setting it here (before any test runs) is early enough. A GPU
    # run (`pytest -m gpu`) compiles the kernels for the device instead.
    markexpr = config.getoption("markexpr") or ""
    if "gpu" not in markexpr.replace("not gpu", ""):
        os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def whole_gpu_memory():
    """Serializes the tests that hold tens of GiB of the GPU (DeepSeek-V3's 256 experts are
    22 GiB in bf16) across pytest-xdist workers: `pytest -m gpu -n 8` would otherwise run eight
    at once on one card. The lock is a file every worker of the machine sees.

    Other GPU tests still run beside the holder (a readers-writer lock over every GPU test was
    tried on 2026-12-06: on an H100 each big test waited for the longest running test to end,
    and the suite got through 37% in the time it takes whole), so a big test must leave room:
    about 35 GiB at most, the size of V3's fp8 experts with their bf16 dequantization."""
    lock_path = os.path.join(tempfile.gettempdir(), "mlagraph-whole-gpu-memory.lock")
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            import torch

            torch.cuda.empty_cache()
            fcntl.flock(lock, fcntl.LOCK_UN)
