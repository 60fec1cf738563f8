"""Dense ragged multi-head attention for prefill (the non-absorbed MLA path).

Requests are packed back to back: request b owns the queries ``q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]``
and the keys/values ``k, v[cu_seqlens_k[b]:cu_seqlens_k[b+1]]``. With a cached prefix the keys are
the prefix followed by the new tokens, so (causally) the new tokens line up with the END of the
keys: query i of a request with len_q queries and len_k keys sees keys j <= i + (len_k - len_q).

DeepSeek runs this with Dqk = 192 (128 nope + 64 rope) and Dv = 128.
"""

from __future__ import annotations

import torch

from ._checks import FLOAT_DTYPES, check_positive, check_same_dtype, check_tensor, fail
from ._define import custom_op
from .decode import masked_softmax


def _check_mha_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, single_request=False) -> None:
    op = "mha_prefill"
    check_tensor(op, "q", q, ndim=3, dtypes=FLOAT_DTYPES)
    _, num_heads, head_dim = q.shape
    dev = q.device
    check_tensor(op, "k", k, shape=(None, num_heads, head_dim), device=dev)
    check_same_dtype(op, "k", k, "q", q)
    check_tensor(op, "v", v, shape=(k.shape[0], num_heads, None), device=dev)
    check_same_dtype(op, "v", v, "q", q)
    check_tensor(op, "cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=(torch.int32,), device=dev)
    if cu_seqlens_q.shape[0] < 1:
        fail(op, "cu_seqlens_q", "B+1 >= 1 offsets", f"shape {list(cu_seqlens_q.shape)}")
    check_tensor(op, "cu_seqlens_k", cu_seqlens_k, shape=(cu_seqlens_q.shape[0],), dtypes=(torch.int32,), device=dev)
    check_positive(op, "softmax_scale", softmax_scale)
    if single_request and (cu_seqlens_q.shape[0] != 2 or q.shape[0] != k.shape[0] or not causal):
        fail(op, "single_request", "True only for one causal request whose queries and keys are the same "
             "tokens (cu_seqlens_q of 2 entries, T == S)", f"T={q.shape[0]}, S={k.shape[0]}, "
             f"B={cu_seqlens_q.shape[0] - 1}, causal={causal}")


@custom_op("mlagraph::mha_prefill", mutates_args=())
def mha_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    single_request: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each request's queries over that request's keys only.

    Args:
        q: [T, H, Dqk] float32/bfloat16/float16.
        k: [S, H, Dqk], same dtype.
        v: [S, H, Dv], same dtype.
        cu_seqlens_q: [B+1] int32 query offsets (non-decreasing; a request may have 0 queries).
            Queries at or past cu_seqlens_q[B] (padding) get out 0 and lse -inf.
        cu_seqlens_k: [B+1] int32 key offsets.
        softmax_scale: > 0, multiplies q.k.
        causal: query i sees keys j <= i + (len_k - len_q) of its request; else all of them.
            A query with no visible key (len_k < len_q) gets out 0 and lse -inf.
        single_request: the caller states the batch is ONE request (B = 1) whose queries and keys
            are the same T tokens (no prefix, no padding rows), causal. The result is the same;
            a backend with ``dense_prefill_sdpa`` may run a dense, non-ragged kernel for it.

    Returns:
        out: [T, H, Dv] in q's dtype; lse: [T, H] float32 natural-log log-sum-exp of the scaled
        scores.
    """
    _check_mha_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, single_request)
    dev = q.device
    num_reqs = cu_seqlens_q.shape[0] - 1
    cu_q, cu_k = cu_seqlens_q.long(), cu_seqlens_k.long()
    q_idx = torch.arange(q.shape[0], device=dev)
    k_idx = torch.arange(k.shape[0], device=dev)
    # 1 + request id of each query / key; 0 or num_reqs + 1 means outside every request.
    q_req = torch.searchsorted(cu_q, q_idx, right=True)
    k_req = torch.searchsorted(cu_k, k_idx, right=True)
    visible = (q_req[:, None] == k_req[None, :]) & (q_req[:, None] >= 1) & (q_req[:, None] <= num_reqs)  # [T, S]
    if causal:
        # Counted back from its request's end, a key must be at least as far as the query:
        # len_k - j >= len_q - i  <=>  j <= i + (len_k - len_q).
        q_to_end = cu_q[q_req.clamp(max=num_reqs)] - q_idx
        k_to_end = cu_k[k_req.clamp(max=num_reqs)] - k_idx
        visible = visible & (k_to_end[None, :] >= q_to_end[:, None])

    scores = torch.einsum("thd,shd->hts", q.float(), k.float()) * softmax_scale
    probs, lse = masked_softmax(scores, visible[None])
    out = torch.einsum("hts,shd->thd", probs, v.float())
    return out.to(q.dtype).contiguous(), lse.transpose(0, 1).contiguous()


@mha_prefill.register_fake
def mha_prefill_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, single_request=False):
    _check_mha_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, single_request)
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2])), q.new_empty(q.shape[:2], dtype=torch.float32)
