"""DeepSeek MoE: routing plus the routed experts, as one op so the model graph stays whole.

``moe`` groups the T*top_k (token, expert) rows by expert (a stable sort and a histogram) and
runs one grouped GEMM per projection (``F.grouped_mm``), so its work is proportional to the
routed rows: static shapes (T*top_k rows, all of them real), no host sync, CUDA-graph
capturable. :func:`moe_all_experts` is the old all-experts implementation, kept as the oracle.

Experts may be fp8 (e4m3 with 128x128 block scales, see :mod:`.fp8`): on CUDA a Triton grouped
GEMM (:mod:`.triton.grouped_fp8`) reads each routed expert's e4m3 bytes once; elsewhere the
weights are dequantized per call (the stored copy stays fp8). Where ``F.grouped_mm`` does not
run (CPU on an older torch) CPU loops over the groups; CUDA without it (float32) takes the
all-experts path, which needs no host sync either.

Shared experts may come in the same call (``shared_gate_proj`` / ``shared_up_proj`` /
``shared_down_proj``, the model's MLP weights as stored, fp8 with their scales): the result is
then the routed sum plus the shared MLP, rounded as the model's ``routed + shared`` is. Here
they run as the MLP would (three linears); a backend may fold them into its routed kernels where
that pays (the triton backend's decode-sized path runs them as extra pairs of its GEMVs).

:func:`route` reproduces transformers' ``DeepseekV2TopkRouter`` (softmax scores, "greedy" or
"group_limited_greedy") and ``DeepseekV3TopkRouter`` (sigmoid scores, "noaux_tc") with the same
torch ops in the same order, so tie-breaking and rounding match. The router linear itself stays
in the model (it runs in float32 there); shared experts are the model's business too.

Real configs: V2-Lite softmax/greedy, V2 softmax/group_limited_greedy (norm_topk_prob False,
routed_scaling_factor 1.0 or 16.0), V3 and V3.2 sigmoid/noaux_tc (norm_topk_prob True, 2.5).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ._checks import FLOAT_DTYPES, check_choice, check_positive, check_same_dtype, check_tensor, fail
from ._define import custom_op
from .fp8 import check_block_scaled, dequantize_blockwise

SCORING_FUNCS = ("softmax", "sigmoid")
# The all-experts oracle: up to this many (token, expert) rows it runs in two batched matmuls
# (their [E, T, D] float32 intermediate stays small), above it one expert at a time.
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
    topk_method, n_group, topk_group, routed_scaling_factor, gate_up_scale, down_scale, first_expert=None,
) -> None:
    op = "moe"
    check_tensor(op, "hidden", hidden, ndim=2, dtypes=FLOAT_DTYPES)
    num_tokens, dim = hidden.shape
    dev = hidden.device
    check_tensor(op, "router_logits", router_logits, shape=(num_tokens, None), device=dev)
    num_experts = router_logits.shape[1]
    if first_expert is None:  # all experts here
        check_tensor(op, "gate_up_proj", gate_up_proj, shape=(num_experts, None, dim), device=dev)
    else:  # expert parallel: this rank's experts first_expert .. first_expert + local - 1
        check_tensor(op, "gate_up_proj", gate_up_proj, shape=(None, None, dim), device=dev)
        local = gate_up_proj.shape[0]
        _check_int(op, "first_expert", first_expert, 0, num_experts - local,
                   f"an int in [0, {num_experts - local}] ({local} local experts of {num_experts})")
        num_experts = local
    if gate_up_proj.shape[1] % 2 != 0:
        shape = list(gate_up_proj.shape)
        fail(op, "gate_up_proj", "an even dim 1 (gate rows, then up rows)", f"shape {shape}")
    inter = gate_up_proj.shape[1] // 2
    check_tensor(op, "down_proj", down_proj, shape=(num_experts, dim, inter), device=dev)
    if (gate_up_scale is None) != (down_scale is None):
        given, missing = ("gate_up_scale", "down_scale") if down_scale is None else ("down_scale", "gate_up_scale")
        fail(op, missing, f"a Tensor, since '{given}' is given (fp8 experts need both scales)", "None")
    if gate_up_scale is None:
        check_same_dtype(op, "gate_up_proj", gate_up_proj, "hidden", hidden)
        check_same_dtype(op, "down_proj", down_proj, "hidden", hidden)
    else:  # fp8 experts: e4m3 weights, float32 scales per 128x128 block
        check_block_scaled(op, "gate_up_proj", gate_up_proj, "gate_up_scale", gate_up_scale,
                           shape=gate_up_proj.shape, device=dev)
        check_block_scaled(op, "down_proj", down_proj, "down_scale", down_scale, shape=down_proj.shape, device=dev)
    _check_routing(
        op, router_logits, e_score_correction_bias, top_k, scoring_func, topk_method, n_group, topk_group,
        routed_scaling_factor,
    )


SHARED_ARGS = ("shared_gate_proj", "shared_up_proj", "shared_down_proj")
SHARED_SCALE_ARGS = ("shared_gate_scale", "shared_up_scale", "shared_down_scale")


def _check_all_or_none(op: str, names: tuple, values: tuple, why: str) -> bool:
    """True if all are given, False if none; else fails naming the first missing one."""
    given = [n for n, v in zip(names, values) if v is not None]
    if given and len(given) < len(names):
        missing = next(n for n, v in zip(names, values) if v is None)
        fail(op, missing, f"a Tensor, since '{given[0]}' is given ({why})", "None")
    return bool(given)


def _check_shared(op, hidden, gate, up, down, gate_scale, up_scale, down_scale) -> None:
    """Shared experts: gate / up [I_s, D] and down [D, I_s] in hidden's dtype, or e4m3 with
    their 128x128 block scales (all three or none); scales only with weights."""
    weights, scales = (gate, up, down), (gate_scale, up_scale, down_scale)
    has_scales = _check_all_or_none(op, SHARED_SCALE_ARGS, scales, "fp8 shared experts need all three scales")
    if not _check_all_or_none(op, SHARED_ARGS, weights, "shared experts need gate, up and down"):
        if has_scales:
            fail(op, "shared_gate_scale", "None when no shared experts are given", "a Tensor")
        return
    dim, dev = hidden.shape[1], hidden.device
    check_tensor(op, "shared_gate_proj", gate, ndim=2, device=dev)
    inter = gate.shape[0]
    shapes = {"shared_gate_proj": (inter, dim), "shared_up_proj": (inter, dim), "shared_down_proj": (dim, inter)}
    for (name, shape), w, scale_name, scale in zip(shapes.items(), weights, SHARED_SCALE_ARGS, scales):
        if has_scales:
            check_block_scaled(op, name, w, scale_name, scale, shape=shape, device=dev)
        else:
            check_tensor(op, name, w, shape=shape, device=dev)
            check_same_dtype(op, name, w, "hidden", hidden)


def check_moe_call(hidden, router_logits, gate_up_proj, down_proj, e_score_correction_bias, top_k, scoring_func,
                   topk_method, n_group, topk_group, norm_topk_prob, routed_scaling_factor, gate_up_scale=None,
                   down_scale=None, first_expert=None, shared_gate_proj=None, shared_up_proj=None,
                   shared_down_proj=None, shared_gate_scale=None, shared_up_scale=None, shared_down_scale=None):
    """The ``moe`` op's argument check, taking the op's own arguments (its fakes and twins share it)."""
    _check_moe(
        hidden, router_logits, gate_up_proj, down_proj, e_score_correction_bias, top_k, scoring_func,
        topk_method, n_group, topk_group, routed_scaling_factor, gate_up_scale, down_scale, first_expert,
    )
    _check_shared("moe", hidden, shared_gate_proj, shared_up_proj, shared_down_proj, shared_gate_scale,
                  shared_up_scale, shared_down_scale)


def shared_experts(hidden, gate, up, down, gate_scale=None, up_scale=None, down_scale=None,
                   activate=None) -> torch.Tensor:
    """The shared experts' MLP: hidden [T, D] -> down(silu(gate hidden) * up hidden) [T, D] in
    hidden's dtype. Each projection in hidden's dtype (float32 accumulation; fp8 weights through
    ``mlagraph.fp8_linear``, as the model's fp8 linears run), silu * up in float32 rounded once
    (as torch.compile computes the model's MLP). ``activate(gate, up, dtype)``: a backend's fused
    silu * up (default :func:`silu_mul_apart`)."""
    def linear(x, w, scale):
        return F.linear(x, w) if scale is None else torch.ops.mlagraph.fp8_linear(x, w, scale)

    act = (activate or silu_mul_apart)(linear(hidden, gate, gate_scale), linear(hidden, up, up_scale), hidden.dtype)
    return linear(act, down, down_scale)


def silu_mul_apart(gate: torch.Tensor, up: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """gate, up [rows, I] -> silu(gate) * up in float32, rounded to dtype."""
    return (F.silu(gate.float()) * up.float()).to(dtype)


def _expert_weights(hidden, gate_up_proj, down_proj, gate_up_scale, down_scale):
    """The experts in hidden's dtype: fp8 ones dequantized (per call; the stored copy stays fp8)."""
    if gate_up_scale is None:
        return gate_up_proj, down_proj
    return (dequantize_blockwise(gate_up_proj, gate_up_scale, hidden.dtype),
            dequantize_blockwise(down_proj, down_scale, hidden.dtype))


@functools.cache
def _grouped_mm_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``F.grouped_mm`` exists and runs for this device type and dtype (torch 2.13 runs
    float32/bfloat16/float16 on CPU; CUDA's fast kernel is bfloat16, where the model runs).
    Probed once on a tiny problem, so the answer is a fact of this torch build, not a guess."""
    if not hasattr(F, "grouped_mm") or (device_type == "cuda" and dtype != torch.bfloat16):
        return False
    try:
        a = torch.ones(16, 16, dtype=dtype, device=device_type)
        F.grouped_mm(a, torch.ones(2, 16, 16, dtype=dtype, device=device_type).transpose(1, 2),
                     offs=torch.tensor([8, 16], dtype=torch.int32, device=device_type))
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _per_group_mm(x: torch.Tensor, w_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """grouped_mm's result, one matmul per group: reads the group ends on the host, so only
    for CPU (no graph to capture, nothing to wait for)."""
    out = x.new_empty(x.shape[0], w_t.shape[2])
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end] @ w_t[g]
        start = end
    return out


def silu_mul(gate_up: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """gate_up [rows, 2I] (a grouped GEMM's output, gate then up) -> silu(gate) * up [rows, I]
    in float32, rounded to dtype. The triton backend fuses this (``mlagraph.ops.triton.moe_glue``)."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(dtype)


def unsort_combine(y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, remote, dtype) -> torch.Tensor:
    """y [T*k, D] in sorted-row order (row i is pair ``order[i]``), weights [T, k] float32 ->
    [T, D]: each token's float32 sum over its k slots in slot order of weight * y, rounded to
    dtype. ``remote`` [T*k] bool or None: pairs another rank computes add nothing."""
    num_tokens, top_k = weights.shape
    y = torch.empty_like(y, dtype=torch.float32).index_copy_(0, order, y.float()).view(num_tokens, top_k, y.shape[1])
    if remote is not None:  # rows past the last group end hold whatever the GEMM left there
        return torch.where(remote.view(num_tokens, top_k, 1), 0.0, y * weights[..., None]).sum(1).to(dtype)
    return (y * weights[..., None]).sum(1).to(dtype)


def _grouped_experts(hidden, weights, ids, num_experts, gate_up_mm, down_mm, first_expert=None,
                     activate=silu_mul, combine=unsort_combine) -> torch.Tensor:
    """hidden [T, D], weights/ids [T, k] -> [T, D]; ``gate_up_mm(x [rows, D], offs) -> [rows, 2I]``
    and ``down_mm(x [rows, I], offs) -> [rows, D]``: the grouped GEMMs, offs [E] int32 group ends;
    ``activate`` and ``combine``: :func:`silu_mul` and :func:`unsort_combine` or a backend's
    fused kernels for them.

    Rows are (token, slot) pairs sorted by expert: T*k rows, every one routed, so no padding
    and nothing data-dependent in any shape. An expert with no rows is an empty group; the
    grouped GEMM never reads its weights.

    Expert parallel (``first_expert`` an int, ``num_experts`` the local count): rows routed to
    another rank's experts sort after every local group, past the last group end, so the
    grouped GEMMs compute nothing for them, and the combine masks them out: the result is this
    rank's partial sum.
    """
    top_k = ids.shape[1]
    flat = ids.reshape(-1)  # [T*k]
    remote = None
    if first_expert is not None:
        flat = flat - first_expert
        remote = (flat < 0) | (flat >= num_experts)  # [T*k] rows another rank computes
        flat = flat.masked_fill(remote, num_experts)  # one extra bin, after every local group
    # int16 keys where the ids fit: a radix sort of 2 bytes, not 8 (2 passes in place of 8 on CUDA).
    keys = flat.to(torch.int16) if num_experts < 2**15 else flat
    order = torch.argsort(keys, stable=True)  # sorted row -> (token, slot) index
    # Histogram without bincount (whose output length depends on the data).
    counts = torch.zeros(num_experts + (remote is not None), dtype=torch.int32, device=hidden.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = counts[:num_experts].cumsum(0, dtype=torch.int32)  # group ends, [E]
    x = hidden.index_select(0, order // top_k)  # [T*k, D]
    y = down_mm(activate(gate_up_mm(x, offs), hidden.dtype), offs)  # [T*k, D], sorted rows
    # Back to (token, slot) order and a float32 sum over each token's k experts (no atomics).
    return combine(y, order, weights, remote, hidden.dtype)


def _grouped_gemms(hidden, gate_up_proj, down_proj, gate_up_scale, down_scale):
    """The two grouped GEMMs for these experts on this device, as ``fn(x, offs)``; None where
    there are none (then the all-experts path runs)."""
    if gate_up_scale is not None and _fp8_kernel_runs(hidden):
        from .triton.grouped_fp8 import fp8_activations_pay, grouped_fp8_mm  # imported only where it runs

        num_experts = gate_up_proj.shape[0]
        return (lambda x, offs: grouped_fp8_mm(x, gate_up_proj, gate_up_scale, offs,
                                               fp8_activations_pay(x, num_experts)),
                lambda x, offs: grouped_fp8_mm(x, down_proj, down_scale, offs, fp8_activations_pay(x, num_experts)))
    gate_up, down = _expert_weights(hidden, gate_up_proj, down_proj, gate_up_scale, down_scale)
    if _grouped_mm_runs(hidden.device.type, hidden.dtype):
        mm = F.grouped_mm
    elif hidden.device.type == "cpu":
        mm = _per_group_mm
    else:
        return None
    return (lambda x, offs: mm(x, gate_up.transpose(1, 2), offs=offs),
            lambda x, offs: mm(x, down.transpose(1, 2), offs=offs))


def _fp8_kernel_runs(hidden: torch.Tensor) -> bool:
    """fp8 experts on CUDA run the Triton grouped fp8 GEMM, which reads each routed expert's
    e4m3 weights once; elsewhere they are dequantized per call (plain PyTorch)."""
    return hidden.device.type == "cuda"


def _all_experts(hidden, weights, ids, gate_up_proj, down_proj, num_routed, first_expert) -> torch.Tensor:
    """Every (local) expert on every token, masked to the routed ones: work proportional to E.
    ``num_routed`` experts in all; expert parallel: this rank's from ``first_expert``."""
    num_tokens, num_experts = hidden.shape[0], gate_up_proj.shape[0]
    # Dense [T, E] combine weights (E is a shape, so no sync), and the routed mask keeps an
    # unrouted expert's output (even inf/nan) out of the sum.
    combine = weights.new_zeros(num_tokens, num_routed).scatter_(1, ids, weights)
    routed = torch.zeros_like(combine, dtype=torch.bool).scatter_(1, ids, True)
    if first_expert is not None:  # this rank's columns
        combine = combine[:, first_expert : first_expert + num_experts]
        routed = routed[:, first_expert : first_expert + num_experts]
    # Expert matmuls run in the weights' dtype (float32 accumulation inside, as transformers
    # does); activations and the sum over experts are float32.
    if num_tokens * num_experts <= _BATCHED_MAX_ROWS:
        # Decode-sized batches: all experts in two batched matmuls, each expert's weights read once.
        gate, up = torch.matmul(hidden, gate_up_proj.transpose(1, 2)).float().chunk(2, dim=-1)  # [E, T, I]
        y = torch.matmul((F.silu(gate) * up).to(hidden.dtype), down_proj.transpose(1, 2)).float()  # [E, T, D]
        return torch.where(routed.T[..., None], combine.T[..., None] * y, 0.0).sum(0).to(hidden.dtype)
    out = hidden.new_zeros(hidden.shape, dtype=torch.float32)
    for e in range(num_experts):
        gate, up = F.linear(hidden, gate_up_proj[e]).float().chunk(2, dim=-1)
        y = F.linear((F.silu(gate) * up).to(hidden.dtype), down_proj[e]).float()
        out = out + torch.where(routed[:, e, None], combine[:, e, None] * y, 0.0)
    return out.to(hidden.dtype)


def moe_all_experts(
    hidden, router_logits, gate_up_proj, down_proj, e_score_correction_bias, top_k, scoring_func, topk_method,
    n_group, topk_group, norm_topk_prob, routed_scaling_factor, gate_up_scale=None, down_scale=None,
    first_expert=None, *shared,
) -> torch.Tensor:
    """The oracle: ``moe``'s arguments and result, computed by running every expert on every
    token (the implementation before grouping). Tests compare the op against it."""
    check_moe_call(
        hidden, router_logits, gate_up_proj, down_proj, e_score_correction_bias, top_k, scoring_func,
        topk_method, n_group, topk_group, norm_topk_prob, routed_scaling_factor, gate_up_scale, down_scale,
        first_expert, *shared,
    )
    weights, ids = route(
        router_logits, e_score_correction_bias, top_k, scoring_func, topk_method, n_group, topk_group,
        norm_topk_prob, routed_scaling_factor,
    )
    gate_up, down = _expert_weights(hidden, gate_up_proj, down_proj, gate_up_scale, down_scale)
    out = _all_experts(hidden, weights, ids, gate_up, down, router_logits.shape[1], first_expert)
    return with_shared(out, hidden, *shared)


def with_shared(routed: torch.Tensor, hidden: torch.Tensor, gate=None, up=None, down=None, gate_scale=None,
                up_scale=None, down_scale=None) -> torch.Tensor:
    """routed [T, D] in hidden's dtype, plus the shared experts' MLP when given (added in that
    dtype, as the model's ``routed + shared``)."""
    if gate is None:
        return routed
    return routed + shared_experts(hidden, gate, up, down, gate_scale, up_scale, down_scale)


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
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
    first_expert: int | None = None,
    shared_gate_proj: torch.Tensor | None = None,
    shared_up_proj: torch.Tensor | None = None,
    shared_down_proj: torch.Tensor | None = None,
    shared_gate_scale: torch.Tensor | None = None,
    shared_up_scale: torch.Tensor | None = None,
    shared_down_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """A DeepSeek MoE layer: the routed experts, grouped by expert, plus the shared experts if given.

    Args:
        hidden: [T, D] float32/bfloat16/float16.
        router_logits: [T, E] float32, the router linear of ``hidden`` (computed in float32).
        gate_up_proj: [E, 2I, D] in hidden's dtype, or e4m3 with ``gate_up_scale``; rows
            0..I-1 gate, I..2I-1 up.
        down_proj: [E, D, I] in hidden's dtype, or e4m3 with ``down_scale``.
        e_score_correction_bias: [E] float32 or None; "noaux_tc" only.
        top_k, scoring_func, topk_method, n_group, topk_group, norm_topk_prob,
            routed_scaling_factor: the routing config, see :func:`route`.
        gate_up_scale: None, or [E, ceil(2I/128), ceil(D/128)] float32 block scales of fp8 gate_up_proj.
        down_scale: None, or [E, ceil(D/128), ceil(I/128)] float32 block scales of fp8 down_proj
            (both scales or neither).
        first_expert: None (``gate_up_proj`` holds all E experts), or expert parallel: the
            weights hold experts first_expert .. first_expert + E_local - 1 of the E that
            ``router_logits`` scores, and the result is their share (the ranks' results sum
            to the whole layer's).
        shared_gate_proj, shared_up_proj: None, or the shared experts' [I_s, D] gate and up
            weights (the model's MLP, n_shared_experts * I wide, or a tensor-parallel rank's
            slice of it); shared_down_proj: [D, I_s]. In hidden's dtype, or e4m3 with
            shared_gate_scale / shared_up_scale / shared_down_scale, their float32 128x128
            block scales. All three weights or none.

    Returns:
        [T, D] in hidden's dtype: sum over the routed experts e of
        weight[t, e] * down_e(silu(gate_e h) * up_e h): the expert matmuls in hidden's dtype
        (float32 accumulation; fp8 experts dequantized to it per call), the activation and the
        sum over experts in float32, rounded to hidden's dtype; then, with shared experts, plus
        :func:`shared_experts` (rounded to hidden's dtype, added in it).
    """
    check_moe_call(
        hidden, router_logits, gate_up_proj, down_proj, e_score_correction_bias, top_k, scoring_func,
        topk_method, n_group, topk_group, norm_topk_prob, routed_scaling_factor, gate_up_scale, down_scale,
        first_expert, shared_gate_proj, shared_up_proj, shared_down_proj, shared_gate_scale, shared_up_scale,
        shared_down_scale,
    )
    weights, ids = route(
        router_logits, e_score_correction_bias, top_k, scoring_func, topk_method, n_group, topk_group,
        norm_topk_prob, routed_scaling_factor,
    )
    out = routed_grouped(hidden, weights, ids, gate_up_proj, down_proj, gate_up_scale, down_scale,
                         router_logits.shape[1], first_expert)
    return with_shared(out, hidden, shared_gate_proj, shared_up_proj, shared_down_proj, shared_gate_scale,
                       shared_up_scale, shared_down_scale)


def routed_grouped(hidden, weights, ids, gate_up_proj, down_proj, gate_up_scale, down_scale, num_routed,
                   first_expert=None, activate=silu_mul, combine=unsort_combine) -> torch.Tensor:
    """``moe``'s result from its routing (weights, ids [T, k]): rows grouped by expert and the
    grouped GEMMs where they run, else the all-experts path. ``num_routed``: E, the experts the
    router scores (more than gate_up_proj holds under expert parallelism); ``activate`` /
    ``combine``: as in :func:`_grouped_experts`."""
    gemms = _grouped_gemms(hidden, gate_up_proj, down_proj, gate_up_scale, down_scale)
    if gemms is not None:
        return _grouped_experts(hidden, weights, ids, gate_up_proj.shape[0], *gemms, first_expert=first_expert,
                                activate=activate, combine=combine)
    # No grouped GEMM for this device and dtype (CUDA float32, say): the all-experts path,
    # which needs no host sync either, so the op stays capturable.
    gate_up, down = _expert_weights(hidden, gate_up_proj, down_proj, gate_up_scale, down_scale)
    return _all_experts(hidden, weights, ids, gate_up, down, num_routed, first_expert)


@moe.register_fake
def moe_fake(*args, **kwargs):
    check_moe_call(*args, **kwargs)
    hidden = args[0] if args else kwargs["hidden"]
    return torch.empty_like(hidden, memory_format=torch.contiguous_format)
