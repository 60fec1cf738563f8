"""Tensor / expert parallel state: the group, this rank, shard ranges, the collectives.

Everything the model needs to know about torch.distributed lives here, so model code calls
``all_reduce(x, ps)`` and never touches a process group. Collectives are torch's functional
ones (``torch.distributed._functional_collectives``): they trace under dynamo fullgraph as
``_c10d_functional.all_reduce`` + ``wait_tensor`` nodes, run eagerly on gloo (CPU) and NCCL
(CUDA), and NCCL ones can be captured in a CUDA graph.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class ParallelState:
    """``world`` ranks of ``group`` (None: no parallelism, world 1); this process is ``rank``."""

    world: int = 1
    rank: int = 0
    group: object = None

    def shard(self, size: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's contiguous 1/world of ``size`` items; ValueError
        naming ``what`` when world does not divide size."""
        if size % self.world != 0:
            raise ValueError(
                f"tensor_parallel_size: expected a divisor of {what} ({size}), got {self.world}"
            )
        n = size // self.world
        return self.rank * n, n


SINGLE = ParallelState()


def parallel_state(tensor_parallel_size: int) -> ParallelState:
    """The state for ``tensor_parallel_size`` ranks: 1 needs nothing; N > 1 needs an initialized
    default process group of world size N (ValueError otherwise, naming the argument)."""
    n = tensor_parallel_size
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"tensor_parallel_size: expected a positive int, got {n!r}")
    if n == 1:
        return SINGLE
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"tensor_parallel_size={n}: expected an initialized default process group of world size {n} "
            "(torch.distributed.init_process_group, e.g. under torchrun), got none"
        )
    if dist.get_world_size() != n:
        raise ValueError(
            f"tensor_parallel_size: expected the default process group's world size "
            f"{dist.get_world_size()}, got {n}"
        )
    return ParallelState(world=n, rank=dist.get_rank(), group=dist.group.WORLD)


def check_divisible(cfg, ps: ParallelState) -> None:
    """Rejects configs whose heads, experts or MLP widths the ranks cannot split evenly."""
    ps.shard(cfg.num_attention_heads, "num_attention_heads")
    if cfg.n_routed_experts:
        ps.shard(cfg.n_routed_experts, "n_routed_experts")
        if cfg.n_shared_experts:
            ps.shard(cfg.moe_intermediate_size * cfg.n_shared_experts, "the shared experts' width")
    ps.shard(cfg.intermediate_size, "intermediate_size")
    ps.shard(cfg.vocab_size, "vocab_size")


def all_reduce(x: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """Sum of ``x`` over the ranks (identity at world 1): [...] -> [...]."""
    if ps.world == 1:
        return x
    return funcol.wait_tensor(funcol.all_reduce(x, "sum", ps.group))


def all_gather_last(x: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """Concatenation over the ranks along the last dim: [..., n] -> [..., world * n]."""
    if ps.world == 1:
        return x
    # all_gather_single where torch has it (all_gather_tensor, the same op, warns from 2.13 on)
    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    return funcol.wait_tensor(gather(x.contiguous(), x.dim() - 1, ps.group))


def vocab_parallel_embedding(ids: torch.Tensor, weight: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """ids [T] over the whole vocabulary, weight [V/world, D] this rank's rows -> [T, D]: each
    rank looks up the ids in its range (zeros elsewhere) and the sum over ranks is the lookup."""
    if ps.world == 1:
        return F.embedding(ids, weight)
    rows = weight.shape[0]
    local = ids - ps.rank * rows
    outside = (local < 0) | (local >= rows)
    out = F.embedding(local.masked_fill(outside, 0), weight)
    return all_reduce(out.masked_fill(outside[:, None], 0), ps)


# How each parameter of a V2/V3/V3.2 model is split across ranks, by the end of its name: the
# dim split evenly; names not listed are replicated. Attention: q and kv_b are
# split by heads (column parallel), o_proj by its input (row parallel, then one all-reduce);
# dense MLPs and shared experts likewise by the intermediate dim; routed experts by expert
# (expert parallel); embedding and lm_head by vocabulary. The latent projection, the norms,
# the router and the DSA indexer are replicated: every rank needs them whole.
SPLIT_PARAMS = {
    "self_attn.q_proj.weight": 0,
    "self_attn.q_b_proj.weight": 0,
    "self_attn.kv_b_proj.weight": 0,
    "self_attn.o_proj.weight": 1,
    "gate_proj.weight": 0,
    "up_proj.weight": 0,
    "down_proj.weight": 1,  # dense MLPs and shared experts (routed experts are stacked, below)
    "experts.gate_up_proj": 0,
    "experts.down_proj": 0,
    "embed_tokens.weight": 0,
    "lm_head.weight": 0,
}


def split_dim(name: str) -> int | None:
    """The dim along which parameter ``name`` is split across ranks, or None (replicated)."""
    for suffix, dim in SPLIT_PARAMS.items():
        if name.endswith(suffix):
            return dim
    return None


def local_slice(name: str, full_shape, ps: ParallelState) -> tuple[int, int, int] | None:
    """(dim, start, length) of this rank's part of parameter ``name`` of ``full_shape``, or None
    when it is replicated (or world is 1)."""
    dim = split_dim(name)
    if dim is None or ps.world == 1:
        return None
    start, n = ps.shard(full_shape[dim], name)
    return dim, start, n
