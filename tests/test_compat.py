"""mlagraph/_compat.py: each torch internal we rely on still exists and still does its job."""

from __future__ import annotations

import torch
from torch.fx.experimental import _config as fx_config

import mlagraph
from mlagraph._compat import no_duck_shapes


def _two_sums(a, b):
    return a.sum() + 2 * b.sum()


def _calls(step) -> None:
    step(torch.ones(3), torch.ones(3))  # equal at the first trace
    step(torch.ones(3), torch.ones(5))
    step(torch.ones(7), torch.ones(4))


def test_no_duck_shapes_switches_the_config():
    assert fx_config.use_duck_shape is True
    with no_duck_shapes():
        assert fx_config.use_duck_shape is False
    assert fx_config.use_duck_shape is True


def test_compiled_step_keeps_equal_dims_apart():
    """Two dimensions equal at the first trace stay two symbols: one graph for all three
    calls. Plain torch.compile ties them (duck shaping) and recompiles when they differ, which
    is what the shim is for."""
    step = mlagraph.compile(_two_sums, backend="mlagraph_eager", attention_backend="reference", passes=(),
                            lint=False, fullgraph=True, dynamic=True)
    _calls(step)
    assert step.num_graphs == 1

    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def _two_sums_copy(a, b):  # its own code object: nothing cached from the step above
        return a.sum() + 2 * b.sum()

    _calls(torch.compile(_two_sums_copy, backend=counting, fullgraph=True, dynamic=True))
    assert len(graphs) == 2
