"""DeepSeek MoE: routing plus the routed experts, as one op so the model graph stays whole.

:func:`route` reproduces transformers' ``DeepseekV2TopkRouter`` (softmax scores, "greedy" or
"group_limited_greedy") and ``DeepseekV3TopkRouter`` (sigmoid scores, "noaux_tc") with the same
torch ops in the same order, so tie-breaking and rounding match. The router linear itself stays
in the model (it runs in float32 there); shared experts are the model's business too.

Real configs: V2-Lite softmax/greedy, V2 softmax/group_limited_greedy (norm_topk_prob False,
routed_scaling_factor 1.0 or 16.0), V3 and V3.2 sigmoid/noaux_tc (norm_topk_prob True, 2.5).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._checks import FLOAT_DTYPES, check_choice, check_positive, check_same_dtype, check_tensor, fail
from ._define import custom_op

SCORING_FUNCS = ("softmax", "sigmoid")
# moe runs every expert on every token; up to this many (token, expert) rows it does so in two
# batched matmuls (their [E, T, D] float32 intermediate stays small), above it one expert at a time.
_BATCHED_MAX_ROWS = 4096
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


def _check_int(op: str, arg: str, value: object, low: int, high: object, expected: str) -> None:
    if not isinstance(value, (int, torch.SymInt)) or isinstance(value, bool):
        fail(op, arg, "an int", type(value).__name__)
    if value < low or value > high:
        fail(op, arg, expected, value)


def _check_routing(
    op, router_logits, e_score_correction_bias, top_k, scoring_func, topk_method, n_group, topk_group,
    routed_scaling_factor,
) -> None:
    check_tensor(op, "router_logits", router_logits, ndim=2, dtypes=(torch.float32,))
    num_experts = router_logits.shape[1]
    check_choice(op, "scoring_func", scoring_func, SCORING_FUNCS)
    check_choice(op, "topk_method", topk_method, TOPK_METHODS)
    if e_score_correction_bias is not None:
        check_tensor(
            op, "e_score_correction_bias", e_score_correction_bias, shape=(num_experts,),
            dtypes=(torch.float32,), device=router_logits.device,
        )
        if topk_method != "noaux_tc":
            fail(op, "e_score_correction_bias", "None unless topk_method is 'noaux_tc'", "a Tensor")
    _check_int(op, "n_group", n_group, 1, num_experts, f"a divisor of the {num_experts} experts")
    if num_experts % n_group != 0:
        fail(op, "n_group", f"a divisor of the {num_experts} experts", n_group)
    group_size = num_experts // n_group
    if topk_method == "noaux_tc" and group_size < 2:
        # noaux_tc scores a group by the sum of its two best experts.
        fail(op, "n_group", f"at most {num_experts // 2} (noaux_tc needs 2 experts per group)", n_group)
    _check_int(op, "topk_group", topk_group, 1, n_group, f"an int in [1, n_group={n_group}]")
    # The grouped methods may only pick among the experts of the kept groups.
    kept = num_experts if topk_method == "greedy" else topk_group * group_size
    _check_int(op, "top_k", top_k, 1, kept, f"an int in [1, {kept}] (experts it may choose from)")
    check_positive(op, "routed_scaling_factor", routed_scaling_factor)


def route(
    router_logits: torch.Tensor,
    e_score_correction_bias: torch.Tensor | None,
    top_k: int,
    scoring_func: str,
    topk_method: str,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek routing: router_logits [T, E] float32 -> (weights [T, top_k] float32,
    ids [T, top_k] int64), in ``torch.topk(sorted=False)`` order like transformers.

    ``e_score_correction_bias`` [E] float32 (or None) is used by "noaux_tc" only, for choosing;
    the weights are always the unbiased scores. "greedy" ignores n_group and topk_group (they
    must still be valid: 1 and 1 will do). ``norm_topk_prob`` is applied as given, also to
    softmax routing (transformers' V2 router never normalizes; real V2 configs say False).
    """
    _check_routing(
        "route", router_logits, e_score_correction_bias, top_k, scoring_func, topk_method, n_group,
        topk_group, routed_scaling_factor,
    )
    num_experts = router_logits.shape[-1]
    if scoring_func == "softmax":
        scores = router_logits.softmax(dim=-1, dtype=torch.float32)
    else:
        scores = router_logits.sigmoid()

    if topk_method == "greedy":
        topk_weights, topk_indices = torch.topk(scores, k=top_k, dim=-1, sorted=False)
    else:
        if topk_method == "group_limited_greedy":
            choice = scores
            group_scores = choice.view(-1, n_group, num_experts // n_group).max(dim=-1).values
            fill = 0.0
        else:  # noaux_tc
            choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias
            group_scores = choice.view(-1, n_group, num_experts // n_group).topk(2, dim=-1)[0].sum(dim=-1)
            fill = float("-inf")
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = (
            group_mask.unsqueeze(-1).expand(-1, n_group, num_experts // n_group).reshape(-1, num_experts)
        )
        choice = choice.masked_fill(~score_mask.bool(), fill)
        if topk_method == "group_limited_greedy":
            topk_weights, topk_indices = torch.topk(choice, k=top_k, dim=-1, sorted=False)
        else:
            topk_indices = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
            topk_weights = scores.gather(1, topk_indices)

    if norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * routed_scaling_factor, topk_indices


def _check_moe(
    hidden, router_logits, gate_up_proj, down_proj, e_score_correction_bias, top_k, scoring_func,
    topk_method, n_group, topk_group, routed_scaling_factor,
) -> None:
    op = "moe"
    check_tensor(op, "hidden", hidden, ndim=2, dtypes=FLOAT_DTYPES)
    num_tokens, dim = hidden.shape
    dev = hidden.device
    check_tensor(op, "router_logits", router_logits, shape=(num_tokens, None), device=dev)
    num_experts = router_logits.shape[1]
    check_tensor(op, "gate_up_proj", gate_up_proj, shape=(num_experts, None, dim), device=dev)
    check_same_dtype(op, "gate_up_proj", gate_up_proj, "hidden", hidden)
    if gate_up_proj.shape[1] % 2 != 0:
        shape = list(gate_up_proj.shape)
        fail(op, "gate_up_proj", "an even dim 1 (gate rows, then up rows)", f"shape {shape}")
    inter = gate_up_proj.shape[1] // 2
    check_tensor(op, "down_proj", down_proj, shape=(num_experts, dim, inter), device=dev)
    check_same_dtype(op, "down_proj", down_proj, "hidden", hidden)
    _check_routing(
        op, router_logits, e_score_correction_bias, top_k, scoring_func, topk_method, n_group, topk_group,
        routed_scaling_factor,
    )


@custom_op("mlagraph::moe", mutates_args=())
def moe(
    hidden: torch.Tensor,
    router_logits: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    e_score_correction_bias: torch.Tensor | None,
    top_k: int,
    scoring_func: str,
    topk_method: str,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> torch.Tensor:
    """Routed experts of a DeepSeek MoE layer (no shared experts).

    Args:
        hidden: [T, D] float32/bfloat16/float16.
        router_logits: [T, E] float32, the router linear of ``hidden`` (computed in float32).
        gate_up_proj: [E, 2I, D] in hidden's dtype; rows 0..I-1 gate, I..2I-1 up.
        down_proj: [E, D, I] in hidden's dtype.
        e_score_correction_bias: [E] float32 or None; "noaux_tc" only.
        top_k, scoring_func, topk_method, n_group, topk_group, norm_topk_prob,
            routed_scaling_factor: the routing config, see :func:`route`.

    Returns:
        [T, D] in hidden's dtype: sum over the routed experts e of
        weight[t, e] * down_e(silu(gate_e h) * up_e h): the expert matmuls in hidden's dtype
        (float32 accumulation), the activation and the sum over experts in float32.
    """
    _check_moe(
        hidden, router_logits, gate_up_proj, down_proj, e_score_correction_bias, top_k, scoring_func,
        topk_method, n_group, topk_group, routed_scaling_factor,
    )
    weights, ids = route(
        router_logits, e_score_correction_bias, top_k, scoring_func, topk_method, n_group, topk_group,
        norm_topk_prob, routed_scaling_factor,
    )
    num_tokens, num_experts = router_logits.shape
    # Dense [T, E] combine weights: every expert runs on every token (E is a shape, so no sync),
    # and the routed mask keeps an unrouted expert's output (even inf/nan) out of the sum.
    combine = weights.new_zeros(num_tokens, num_experts).scatter_(1, ids, weights)
    routed = torch.zeros_like(combine, dtype=torch.bool).scatter_(1, ids, True)
    # Expert matmuls run in the weights' dtype (float32 accumulation inside, as transformers
    # does); activations and the sum over experts are float32.
    if num_tokens * num_experts <= _BATCHED_MAX_ROWS:
        # Decode-sized batches: all experts in two batched matmuls, each expert's weights read
        # once, instead of 4 kernels per expert (launch-bound at decode).
        gate, up = torch.matmul(hidden, gate_up_proj.transpose(1, 2)).float().chunk(2, dim=-1)  # [E, T, I]
        y = torch.matmul((F.silu(gate) * up).to(hidden.dtype), down_proj.transpose(1, 2)).float()  # [E, T, D]
        return torch.where(routed.T[..., None], combine.T[..., None] * y, 0.0).sum(0).to(hidden.dtype)
    out = hidden.new_zeros(hidden.shape, dtype=torch.float32)
    for e in range(num_experts):
        gate, up = F.linear(hidden, gate_up_proj[e]).float().chunk(2, dim=-1)
        y = F.linear((F.silu(gate) * up).to(hidden.dtype), down_proj[e]).float()
        out = out + torch.where(routed[:, e, None], combine[:, e, None] * y, 0.0)
    return out.to(hidden.dtype)


@moe.register_fake
def moe_fake(
    hidden, router_logits, gate_up_proj, down_proj, e_score_correction_bias, top_k, scoring_func,
    topk_method, n_group, topk_group, norm_topk_prob, routed_scaling_factor,
):
    _check_moe(
        hidden, router_logits, gate_up_proj, down_proj, e_score_correction_bias, top_k, scoring_func,
        topk_method, n_group, topk_group, routed_scaling_factor,
    )
    return torch.empty_like(hidden, memory_format=torch.contiguous_format)
