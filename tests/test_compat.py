"""mlagraph/_compat.py: each torch internal we rely on still exists and still does its job."""

from __future__ import annotations

import torch
from torch.fx.experimental import _config as fx_config

import mlagraph
from mlagraph._compat import symbolic_sizes


def _two_sums(a, b):
    return a.sum() + 2 * b.sum()


def _calls(step) -> None:
    step(torch.ones(3), torch.ones(3))  # equal at the first trace
    step(torch.ones(3), torch.ones(5))
    step(torch.ones(7), torch.ones(4))


def test_symbolic_sizes_switches_the_config():
    assert fx_config.use_duck_shape is True and fx_config.backed_size_oblivious is False
    with symbolic_sizes():
        assert fx_config.use_duck_shape is False and fx_config.backed_size_oblivious is True
    assert fx_config.use_duck_shape is True and fx_config.backed_size_oblivious is False


def _row_sums(a):
    return a.sum(1) * 2


def test_compiled_step_does_not_specialise_a_size_of_one():
    """Traced at 8 rows, then called with 1 and 3: one graph. Plain torch.compile specialises
    the size-1 call (a second graph), which is what the second switch is for."""
    step = mlagraph.compile(_row_sums, backend="mlagraph_eager", attention_backend="reference", passes=(),
                            lint=False, fullgraph=True, dynamic=True)
    for rows in (8, 1, 3):
        torch.testing.assert_close(step(torch.ones(rows, 4)), torch.full((rows,), 8.0))
    assert step.num_graphs == 1

    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def _row_sums_copy(a):
        return a.sum(1) * 2

    plain = torch.compile(_row_sums_copy, backend=counting, fullgraph=True, dynamic=True)
    for rows in (8, 1, 3):
        plain(torch.ones(rows, 4))
    assert len(graphs) == 2


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
