"""DeepSeek's routing in one launch: router logits [T, E] -> (weights [T, k], ids [T, k]).

The generic :func:`mlagraph.ops.moe.route` is the torch ops transformers runs: softmax or
sigmoid, a top-k over groups (``group_limited_greedy``: each group's best score; ``noaux_tc``:
the sum of its best two, biased), a mask, a second top-k, a gather, a normalisation and a scale.
That is five to twelve kernels a MoE layer; at decode each costs more than its work (the H200
profile of a V2-Lite step at batch 1 spends 0.35 ms of 4.1 on routing). Here one program per
token holds its E scores in registers ([groups, experts a group]) and picks the top-k by k
rounds of (max, first index of the max, knock it out).

Same choice as the generic op, up to ties: of equal scores the lower expert id is taken (where
``torch.topk`` leaves the order of ties unspecified), and ids come out best first (where
``torch.topk(sorted=False)`` leaves them in its own order); the layer's output is a sum over the
slots, so only its float rounding order differs. Weights are the unbiased scores at the chosen
ids, normalised (``norm_topk_prob``) and scaled as the generic op does, in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._hardware import interpreted
from ._launch import check_runnable

METHODS = {"greedy": 0, "group_limited_greedy": 1, "noaux_tc": 2}


@triton.jit
def _argmax(values, idx, none: tl.constexpr, AXIS: tl.constexpr):
    """(max of ``values`` along AXIS, the smallest ``idx`` holding it; ``none`` where no lane
    does (NaN)): every top-k round of the router is one of these."""
    best = tl.max(values, AXIS)
    return best, tl.min(tl.where(values == tl.expand_dims(best, AXIS), idx, none), AXIS)


@triton.jit
def _argmax_2d(values, idx, none: tl.constexpr):
    """:func:`_argmax` over a whole [groups, experts a group] tile: each row's, then the rows'
    (idx grows along rows, then columns, so the first row holding the max has the smallest)."""
    row_best, row_first = _argmax(values, idx, none, 1)
    return _argmax(row_best, row_first, none, 0)


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, stride_lt, scaling,
    E: tl.constexpr, N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr,
    TOP_K: tl.constexpr, SOFTMAX: tl.constexpr, METHOD: tl.constexpr, HAS_BIAS: tl.constexpr,
    NORM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0)
    g = tl.arange(0, BLOCK_G)[:, None]
    s = tl.arange(0, BLOCK_S)[None, :]
    valid = (g < N_GROUP) & (s < GROUP_SIZE)
    expert = g * GROUP_SIZE + s  # [BLOCK_G, BLOCK_S]
    x = tl.load(logits_ptr + t.to(tl.int64) * stride_lt + expert, mask=valid, other=float("-inf"))
    if SOFTMAX:
        e = tl.where(valid, tl.exp(x - tl.max(tl.max(x, 1), 0)), 0.0)
        scores = e / tl.sum(tl.sum(e, 1), 0)
    else:
        scores = 1.0 / (1.0 + tl.exp(-x))
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + expert, mask=valid, other=0.0)
    choice = tl.where(valid, choice, float("-inf"))
    if METHOD != 0:
        # Score each group, keep the best TOPK_GROUP of them, mask the experts of the others.
        best, first = _argmax(choice, s, BLOCK_S, 1)  # [BLOCK_G] each
        if METHOD == 2:  # noaux_tc: the sum of the group's two best (biased) scores
            best = best + tl.max(tl.where(s == first[:, None], float("-inf"), choice), 1)
        gid = tl.arange(0, BLOCK_G)
        group_score = tl.where(gid < N_GROUP, best, float("-inf"))
        kept = gid < 0
        for _ in tl.static_range(TOPK_GROUP):
            _, pick = _argmax(group_score, gid, BLOCK_G, 0)
            kept = kept | (gid == pick)
            group_score = tl.where(gid == pick, float("-inf"), group_score)
        # group_limited_greedy fills 0 (as transformers' V2 does), noaux_tc -inf
        fill = 0.0 if METHOD == 1 else float("-inf")
        choice = tl.where(valid & kept[:, None], choice, tl.where(valid, fill, float("-inf")))
    # the weight of a pick: its unbiased score (noaux_tc), else the value it was picked by
    # (group_limited_greedy's masked experts weigh the fill, as the generic op's topk values do)
    source = scores if METHOD == 2 else choice
    slot = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_K], tl.int32)
    for j in tl.static_range(TOP_K):
        _, pick = _argmax_2d(choice, expert, E)
        pick = tl.minimum(pick, E - 1)  # NaN logits: some valid expert, never an address past E
        hit = (expert == pick) & valid  # padding lanes repeat the next group's ids: never them
        w = tl.sum(tl.sum(tl.where(hit, source, 0.0), 1), 0)
        weights = tl.where(slot == j, w, weights)
        ids = tl.where(slot == j, pick, ids)
        choice = tl.where(hit, float("-inf"), choice)
    if NORM:
        weights = weights / (tl.sum(weights, 0) + 1e-20)
    out = t.to(tl.int64) * TOP_K + slot
    tl.store(weights_ptr + out, weights * scaling, mask=slot < TOP_K)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=slot < TOP_K)


def route(router_logits, e_score_correction_bias, top_k, scoring_func, topk_method, n_group, topk_group,
          norm_topk_prob, routed_scaling_factor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`mlagraph.ops.moe.route`'s arguments (already checked by the op's check) and
    results: weights [T, top_k] float32, ids [T, top_k] int64, best first."""
    check_runnable("moe", _route_kernel, router_logits)
    num_tokens, num_experts = router_logits.shape
    groups = 1 if topk_method == "greedy" else n_group
    group_size = num_experts // groups
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    bias = e_score_correction_bias if topk_method == "noaux_tc" else None
    block = triton.next_power_of_2(num_experts)
    _route_kernel[(num_tokens,)](
        logits, logits if bias is None else bias, weights, ids, logits.stride(0), float(routed_scaling_factor),
        E=num_experts, N_GROUP=groups, GROUP_SIZE=group_size, TOPK_GROUP=topk_group if groups > 1 else 1,
        TOP_K=top_k, SOFTMAX=scoring_func == "softmax", METHOD=METHODS[topk_method], HAS_BIAS=bias is not None,
        NORM=bool(norm_topk_prob), BLOCK_G=triton.next_power_of_2(groups),
        BLOCK_S=triton.next_power_of_2(group_size), BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=1 if block <= 256 or interpreted(_route_kernel) else 4,
    )
    return weights, ids
