"""The triton backend's registration: its capability table, and ops that are exact twins of
the generic ops (same schema, same checks, same fake kernel) so the model and the passes can
swap one for the other."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from mlagraph.ops import backends
from mlagraph.ops.triton import _launch

V4_KERNELS = ("swa_decode", "hca_decode", "csa_decode", "swa_attention", "hca_attention", "csa_attention",
              "compressor_update", "csa_indexer_topk")


def test_registered_and_available():
    assert "triton" in backends.names()
    b = backends.get("triton")
    assert b.available and b.name == "triton"


def test_capability_table():
    caps = backends.get("triton").capabilities
    assert caps.latent_layouts == {"bf16", "fp8", "fp8_ds"} and caps.indexer_layouts == {"bf16", "fp8"}
    # Unlike aiter, its fused op returns K: nothing downstream has to avoid it.
    assert caps.fused_rope_cache and caps.fused_applies_rope and caps.fused_writes_cache
    assert caps.fused_returns_k
    assert caps.decode_q_split and caps.multi_token_decode and caps.mha_over_prefix and caps.sparse_mla
    assert caps.cuda_graph_safe == frozenset(backends.GENERIC_OPS)
    # No kernels of ours for V4's MoE and window-cache write: the reference ops, declared.
    assert dict(caps.fallbacks) == {g: "reference" for g in backends.V4_OPS if g not in V4_KERNELS}
    assert "moe" not in caps.fallbacks


@pytest.mark.parametrize("generic", backends.GENERIC_OPS)
def test_each_op_is_a_twin_of_the_generic_op(generic):
    b = backends.get("triton")
    fallback = b.capabilities.fallbacks.get(generic)
    owner = backends.get(fallback) if fallback else b
    assert b.op(generic) is owner.op(generic) if fallback else b.op_names[generic] == f"mlagraph_triton::{generic}"
    mine = b.op(generic).default._schema
    ref = getattr(torch.ops.mlagraph, generic).default._schema
    assert [(a.name, str(a.type), a.alias_info is not None and a.alias_info.is_write) for a in mine.arguments] == [
        (a.name, str(a.type), a.alias_info is not None and a.alias_info.is_write) for a in ref.arguments
    ]
    assert [str(r.type) for r in mine.returns] == [str(r.type) for r in ref.returns]


def test_owned_ops_are_the_triton_namespace():
    owned = backends.get("triton").owned_ops()
    reference_only = set(backends.V4_OPS) - set(V4_KERNELS)
    assert owned == {f"mlagraph_triton::{g}" for g in backends.GENERIC_OPS if g not in reference_only}


def _copy(X, Y, BLOCK: tl.constexpr):
    tl.store(Y + tl.arange(0, BLOCK), tl.load(X + tl.arange(0, BLOCK)))


def test_compiled_kernel_on_cpu_tensors_is_a_clear_error():
    """A kernel compiled for the GPU (not the interpreter) refuses CPU tensors by name."""
    compiled = JITFunction(_copy)
    with pytest.raises(ValueError, match=r"mlagraph_triton\.mla_decode: .*expected CUDA tensors.*TRITON_INTERPRET=1.*got device cpu"):
        _launch.check_runnable("mla_decode", compiled, torch.zeros(4))
    _launch.check_runnable("mla_decode", triton.jit(_copy), torch.zeros(4))  # interpreted here: fine
