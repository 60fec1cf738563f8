"""The torch internals mlagraph relies on where torch has no public API, each in one place and
each pinned by a test (tests/test_compat.py), so a torch upgrade that moves one fails loudly.

- :func:`no_duck_shapes`: dynamo gives two dynamic dimensions one symbol when they happen to be
  equal at the first trace ("duck shaping"): a decode batch of 2 requests with a block table 2
  pages wide would tie the request count to the table width, and the next batch where they
  differ would recompile. Our token, request, page and logits dimensions are independent, so
  :class:`mlagraph.compiler.CompiledStep` traces with duck shaping off. ``torch.compile`` has no
  option for it; ``torch._dynamo.maybe_mark_dynamic`` (public) gives non-duck symbols only to
  the dimensions it marks, and it cannot mark host ints (a batch's token counts), so the config
  switch stays the simplest exact answer.
- :func:`specialized_floats`: a regional step passes each layer module to its compiled region
  as an argument, and dynamo (``specialize_float=False``, its default since 2.6) traces the
  float attributes of an argument (eps, softmax scale, routing factor) as symbolic floats, then
  finds it cannot keep them symbolic and restarts the whole trace with them as constants: two
  traces per region. Treating them as constants from the start gives the same graph (and a
  guard on each value, which layers of one kind share) at half the tracing time.
"""

from __future__ import annotations

import contextlib

import torch._dynamo
from torch.fx.experimental import _config as _fx_config


def no_duck_shapes() -> contextlib.AbstractContextManager:
    """A context in which dynamo traces every dynamic dimension as its own symbol."""
    return _fx_config.patch(use_duck_shape=False)


def specialized_floats() -> contextlib.AbstractContextManager:
    """A context in which dynamo traces the Python floats it reads as constants."""
    if not hasattr(torch._dynamo.config, "specialize_float"):  # older torch: always constants
        return contextlib.nullcontext()
    return torch._dynamo.config.patch(specialize_float=True)
