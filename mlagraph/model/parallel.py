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


def all_reduce(x: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """Sum of ``x`` over the ranks (identity at world 1): [...] -> [...]."""
    if ps.world == 1:
        return x
    return funcol.wait_tensor(funcol.all_reduce(x, "sum", ps.group))


def all_gather_last(x: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """Concatenation over the ranks along the last dim: [..., n] -> [..., world * n]."""
    if ps.world == 1:
        return x
    return funcol.wait_tensor(funcol.all_gather_tensor(x.contiguous(), x.dim() - 1, ps.group))
