"""A test-only second backend shaped like AMD aiter's real contract, so the passes, the lints and
the compiler can be tested against two backends on the CPU.

aiter's ``fused_qk_rope_cat_and_cache`` rotates q_pe and k_pe, concatenates q, writes the latent
cache, and hands back q and an EMPTY K: it writes K to the cache and returns nothing usable.
A consumer that reads that K is the seed bug of docs/design.md rule 1 (a null-K GPU fault).

- ``mlagraph_test::fused_qk_rope_cat_and_cache``: a private op with the schema of
  ``mlagraph::fused_rope_concat_cache_write``; the math is the reference composition (the same
  Python functions, not a copy), the K it returns is a ``[0]`` tensor. ``CALLS`` counts its real
  (non-fake) executions, so a test can see which op a compiled graph actually ran.
- ``registered_backend(name, op_names=..., **capability_overrides)``: a context manager that
  registers a ``Backend`` made from the reference backend's table with the overrides, and
  removes it afterwards (the backend registry is process-wide and the lints read all of it).
- ``aiter_like(name)``: that, with ``fused_returns_k=False`` and the fused op mapped to the
  private op; the ``fake_aiter`` fixture yields one for a test.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses

import pytest
import torch

from mlagraph.ops import backends
from mlagraph.ops.cache import _check_fused, _write
from mlagraph.ops.rope import rope_reference

FAKE_OP = "mlagraph_test::fused_qk_rope_cat_and_cache"
FAKE_AITER = "fake_aiter"

CALLS: collections.Counter = collections.Counter()  # op name -> real executions


@torch.library.custom_op(FAKE_OP, mutates_args=("kv_cache",))
def fused_qk_rope_cat_and_cache(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: torch.Tensor | None,
    layout: str,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``mlagraph::fused_rope_concat_cache_write``, but returns (q, empty K [0])."""
    _check_fused(q_nope, q_pe, kv_c, k_pe, positions, cos_sin_cache, kv_cache, slot_mapping, scale, layout)
    q_rot, k_rot = rope_reference(q_pe, k_pe, positions, cos_sin_cache, interleaved)
    _write(kv_c, k_rot[:, 0], kv_cache, slot_mapping, scale, layout)
    CALLS[FAKE_OP] += 1
    return torch.cat([q_nope, q_rot], dim=-1), k_pe.new_empty((0,))


@fused_qk_rope_cat_and_cache.register_fake
def _(q_nope, q_pe, kv_c, k_pe, positions, cos_sin_cache, kv_cache, slot_mapping, scale, layout, interleaved):
    _check_fused(q_nope, q_pe, kv_c, k_pe, positions, cos_sin_cache, kv_cache, slot_mapping, scale, layout)
    t, h, dn = q_nope.shape
    return q_nope.new_empty((t, h, dn + q_pe.shape[2])), k_pe.new_empty((0,))


@contextlib.contextmanager
def registered_backend(name: str, *, op_names: dict[str, str] | None = None, **capability_overrides):
    """Registers ``name`` = the reference backend with overrides for the duration of the block.

    ``capability_overrides`` replace fields of the reference ``Capabilities``
    (e.g. ``fused_returns_k=False``); ``op_names`` replaces entries of its generic-op map
    (e.g. ``{"fused_rope_concat_cache_write": FAKE_OP}``). Yields the registered ``Backend``.
    """
    if name in backends.names():
        raise ValueError(f"registered_backend: {name!r} is already registered")
    ref = backends.get("reference")
    backend = backends.Backend(
        name=name,
        capabilities=dataclasses.replace(ref.capabilities, **capability_overrides),
        op_names={**ref.op_names, **(op_names or {})},
    )
    backends.register(backend)
    try:
        yield backend
    finally:
        backends.unregister(name)


def aiter_like(name: str = FAKE_AITER):
    """A backend whose fused op is the private one and returns no K (aiter's contract)."""
    return registered_backend(
        name, op_names={"fused_rope_concat_cache_write": FAKE_OP}, fused_returns_k=False
    )


@pytest.fixture
def fake_aiter():
    """The aiter-like backend, registered for one test only."""
    with aiter_like() as backend:
        yield backend
