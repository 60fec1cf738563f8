"""DeepSeek-V4 MoE: its routing (learned top-k or token-id hash) plus the clamped SwiGLU experts.

V4 differs from V3's MoE (:mod:`.moe`) in three places, which is why it is its own op:

- scores are ``sqrtsoftplus(logits) = sqrt(softplus(logits))`` (or sigmoid / softmax);
- the first layers route by a frozen table, ``hash_ids = tid2eid[input_ids]``, instead of a
  top-k; the other layers take the top-k of ``scores + e_score_correction_bias`` (no groups);
- the experts clip their pre-activations: ``silu(min(gate, limit)) * clamp(up, -limit, limit)``.

Either way the weights are the chosen experts' unbiased scores, normalised to sum to one, times
``routed_scaling_factor``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._checks import FLOAT_DTYPES, check_choice, check_positive, check_same_dtype, check_tensor, fail
from ._define import custom_op

SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")


def _check_v4_moe(hidden, router_logits, gate_up_proj, down_proj, e_score_correction_bias, hash_ids, top_k,
                  scoring_func, routed_scaling_factor, swiglu_limit) -> None:
    op = "v4_moe"
    check_tensor(op, "hidden", hidden, ndim=2, dtypes=FLOAT_DTYPES)
    num_tokens, dim = hidden.shape
    dev = hidden.device
    check_tensor(op, "router_logits", router_logits, shape=(num_tokens, None), dtypes=(torch.float32,), device=dev)
    num_experts = router_logits.shape[1]
    check_tensor(op, "gate_up_proj", gate_up_proj, shape=(num_experts, None, dim), device=dev)
    check_same_dtype(op, "gate_up_proj", gate_up_proj, "hidden", hidden)
    if gate_up_proj.shape[1] % 2:
        fail(op, "gate_up_proj", "an even dim 1 (gate rows, then up rows)", f"shape {list(gate_up_proj.shape)}")
    check_tensor(op, "down_proj", down_proj, shape=(num_experts, dim, gate_up_proj.shape[1] // 2), device=dev)
    check_same_dtype(op, "down_proj", down_proj, "hidden", hidden)
    if not isinstance(top_k, (int, torch.SymInt)) or isinstance(top_k, bool) or not 1 <= top_k <= num_experts:
        fail(op, "top_k", f"an int in [1, {num_experts}]", top_k)
    if (e_score_correction_bias is None) == (hash_ids is None):
        fail(op, "hash_ids", "exactly one of e_score_correction_bias (top-k routing) and hash_ids (hash routing)",
             "both" if hash_ids is not None else "neither")
    if e_score_correction_bias is not None:
        check_tensor(op, "e_score_correction_bias", e_score_correction_bias, shape=(num_experts,),
                     dtypes=(torch.float32,), device=dev)
    if hash_ids is not None:
        check_tensor(op, "hash_ids", hash_ids, shape=(num_tokens, top_k), dtypes=(torch.int64,), device=dev)
    check_choice(op, "scoring_func", scoring_func, SCORING_FUNCS)
    check_positive(op, "routed_scaling_factor", routed_scaling_factor)
    check_positive(op, "swiglu_limit", swiglu_limit)


def v4_route(router_logits, e_score_correction_bias, hash_ids, top_k, scoring_func, routed_scaling_factor):
    """-> (weights [T, top_k] float32, expert ids [T, top_k] int64)."""
    if scoring_func == "sqrtsoftplus":
        scores = F.softplus(router_logits).sqrt()
    elif scoring_func == "sigmoid":
        scores = router_logits.sigmoid()
    else:
        scores = router_logits.softmax(dim=-1)
    if hash_ids is None:
        ids = torch.topk(scores + e_score_correction_bias, top_k, dim=-1, sorted=False).indices
    else:
        ids = hash_ids
    weights = scores.gather(1, ids)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


@custom_op("mlagraph::v4_moe", mutates_args=())
def v4_moe(
    hidden: torch.Tensor, router_logits: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
    e_score_correction_bias: torch.Tensor | None, hash_ids: torch.Tensor | None, top_k: int, scoring_func: str,
    routed_scaling_factor: float, swiglu_limit: float,
) -> torch.Tensor:
    """Routed experts of a V4 MoE layer (no shared experts).

    Args:
        hidden: [T, D] float32/bfloat16/float16.
        router_logits: [T, E] float32.
        gate_up_proj: [E, 2I, D] (gate rows, then up rows); down_proj: [E, D, I]; hidden's dtype.
        e_score_correction_bias: [E] float32 for top-k routing, None for hash routing.
        hash_ids: [T, top_k] int64 expert ids for hash routing (``tid2eid[input_ids]``), else None.
        top_k, scoring_func, routed_scaling_factor: the routing config (module docstring).
        swiglu_limit: > 0, the pre-activation clip.

    Returns:
        [T, D] in hidden's dtype; activations and the sum over experts in float32.
    """
    _check_v4_moe(hidden, router_logits, gate_up_proj, down_proj, e_score_correction_bias, hash_ids, top_k,
                  scoring_func, routed_scaling_factor, swiglu_limit)
    weights, ids = v4_route(router_logits, e_score_correction_bias, hash_ids, top_k, scoring_func,
                            routed_scaling_factor)
    num_tokens, num_experts = router_logits.shape
    # Dense [T, E] combine weights (E is a shape: no sync); the mask keeps an unrouted expert's
    # output out of the sum even if it overflowed. scatter_add: a hash table may repeat an expert.
    combine = weights.new_zeros(num_tokens, num_experts).scatter_add_(1, ids, weights)
    routed = torch.zeros_like(combine, dtype=torch.bool).scatter_(1, ids, True)
    out = hidden.new_zeros(hidden.shape, dtype=torch.float32)
    for e in range(num_experts):
        gate, up = F.linear(hidden, gate_up_proj[e]).float().chunk(2, dim=-1)
        act = F.silu(gate.clamp(max=swiglu_limit)) * up.clamp(-swiglu_limit, swiglu_limit)
        y = F.linear(act.to(hidden.dtype), down_proj[e]).float()
        out = out + torch.where(routed[:, e, None], combine[:, e, None] * y, 0.0)
    return out.to(hidden.dtype)


@v4_moe.register_fake
def _v4_moe_fake(hidden, router_logits, gate_up_proj, down_proj, e_score_correction_bias, hash_ids, top_k,
                 scoring_func, routed_scaling_factor, swiglu_limit):
    _check_v4_moe(hidden, router_logits, gate_up_proj, down_proj, e_score_correction_bias, hash_ids, top_k,
                  scoring_func, routed_scaling_factor, swiglu_limit)
    return torch.empty_like(hidden, memory_format=torch.contiguous_format)
