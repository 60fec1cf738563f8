import pytest
import torch


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles its own models: start from an empty dynamo cache, so the guards of
    earlier tests' models (same code objects) never count towards the recompile limit."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
