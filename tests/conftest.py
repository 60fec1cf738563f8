"""Fixtures shared by every test package (the transformers oracle checkpoints live in
tests/model/conftest.py; the compile tests use them too)."""

from tests.model.conftest import hf_checkpoint  # noqa: F401  (re-exported fixture)
