"""The torch internals mlagraph relies on where torch has no public API, each in one place and
each pinned by a test (tests/test_compat.py), so a torch upgrade that moves one fails loudly.

- :func:`symbolic_sizes`: two switches of the symbolic-shape config.
  Duck shaping off: dynamo gives two dynamic dimensions one symbol when they happen to be equal
  at the first trace ("duck shaping"): a decode batch of 2 requests with a block table 2 pages
  wide would tie the request count to the table width, and the next batch where they differ
  would recompile. Our token, request, page and logits dimensions are independent.
  Size-oblivious backed sizes: dynamo specialises a dimension it sees as 0 or 1 (and guards
  ``!= 1`` on the symbols of larger ones), so a step traced at 8 tokens recompiled for a
  one-token decode (a CUDA graph's bucket 1). With ``backed_size_oblivious`` a size-1
  dimension gets a symbol like any other; the model avoids the few ops whose size-1 checks
  still guard (``model.attention.per_head_matmul`` says which).
  ``torch.compile`` has no option for either; ``torch._dynamo.maybe_mark_dynamic`` (public)
  gives non-duck symbols only to the dimensions it marks, and it cannot mark host ints (a
  batch's token counts), so the config switches stay the simplest exact answer.
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


def symbolic_sizes() -> contextlib.AbstractContextManager:
    """A context in which dynamo traces every dynamic dimension as its own symbol, a size of 1
    included."""
    return _fx_config.patch(use_duck_shape=False, backed_size_oblivious=True)


def specialized_floats() -> contextlib.AbstractContextManager:
    """A context in which dynamo traces the Python floats it reads as constants."""
    if not hasattr(torch._dynamo.config, "specialize_float"):  # older torch: always constants
        return contextlib.nullcontext()
    return torch._dynamo.config.patch(specialize_float=True)
