"""Manifold-constrained hyper-connections (mHC), DeepSeek-V4's residual stream.

Instead of one residual vector per token, V4 carries N = ``hc_mult`` streams ``x [T, N, D]``.
Around each block (attention, MoE) a small projection of all streams yields three mixings:

    pre  [T, N]     sigmoid(...) + eps            collapses the streams into the block input
    post [T, N]     2·sigmoid(...)                spreads the block output back over the streams
    comb [T, N, N]  Sinkhorn(softmax(...) + eps)  mixes the old streams (doubly stochastic)

    x_next[t, k] = post[t, k] · block(sum_j pre[t, j] x[t, j])[t] + sum_j comb[t, j, k] · x[t, j]

The projections run in float32 on the RMS-normalised (unweighted) flattened streams.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


class HyperConnection(nn.Module):
    """One block's mixings. Parameters (HF names): fn [(2+N)·N, N·D], base [(2+N)·N], scale [3]."""

    def __init__(self, hc_mult: int, hidden_size: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
        super().__init__()
        n = hc_mult
        self.n, self.iters, self.hc_eps, self.norm_eps = n, sinkhorn_iters, hc_eps, norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, N, D] -> (block input [T, D], post [T, N] float32, comb [T, N, N] float32)."""
        n = self.n
        mix = F.linear(_unit_rms(x.flatten(1).float(), self.norm_eps), self.fn.float())  # [T, (2+N)·N]
        pre_w, post_w = mix.split([n, n, n * n], dim=-1)[:2]
        # [T, N, N] from the whole (contiguous) mix, not by viewing its strided slice: Inductor's
        # view of that slice would ask whether T == 1 (a one-token step would compile again)
        comb_w = mix.unflatten(-1, (2 + n, n))[:, 2:]
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        s_pre, s_post, s_comb = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * s_pre + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * s_post + post_b)
        comb = torch.softmax(comb_w * s_comb + comb_b.view(n, n), dim=-1) + self.hc_eps
        # Sinkhorn-Knopp: alternate column and row normalisation towards a doubly stochastic
        # matrix, starting (and ending) with the columns, iters column passes in all.
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        block_in = (pre[..., None] * x).sum(dim=1).to(x.dtype)
        return block_in, post, comb

    @staticmethod
    def merge(x: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """x [T, N, D], block_out [T, D] -> the next streams [T, N, D]."""
        mixed = torch.bmm(comb.to(x.dtype).transpose(1, 2), x)  # [T, k, D] = sum_j comb[t, j, k] x[t, j]
        return post.to(x.dtype)[..., None] * block_out[:, None, :] + mixed


class HyperHead(nn.Module):
    """The final collapse of the streams. Parameters (HF names): hc_fn [N, N·D], hc_base [N], hc_scale [1]."""

    def __init__(self, hc_mult: int, hidden_size: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = nn.Parameter(torch.empty(hc_mult, hc_mult * hidden_size, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.empty(hc_mult, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.empty(1, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, N, D] -> [T, D]."""
        mix = F.linear(_unit_rms(x.flatten(1).float(), self.norm_eps), self.hc_fn.float())
        pre = torch.sigmoid(mix * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre[..., None] * x).sum(dim=1).to(x.dtype)
