"""Triton-kernel tests run twice: on CPU through Triton's interpreter (tiny shapes, in CI) and
on CUDA (marked ``gpu``; `pytest -m gpu` on the H200)."""

import pytest
import torch

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=DEVICES)
def device(request):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.fail("gpu tests need a CUDA device")
    return torch.device(request.param)
