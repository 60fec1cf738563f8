"""parallel.py on gloo: argument checks, shard ranges, and the functional collectives eagerly
and compiled (dynamo fullgraph), in spawned processes with a bounded run time."""

from __future__ import annotations


import pytest
import torch

from mlagraph.model import parallel
from mlagraph.model.config import DeepseekConfig
from tests.model.conftest import hf_config
from tests.ranks import gloo_group, spawn_ranks



def _worker(rank: int, world: int, init_method: str) -> None:
    with gloo_group(rank, world, init_method, seconds=60):
        with pytest.raises(ValueError, match="world size"):
            parallel.parallel_state(world + 1)
        ps = parallel.parallel_state(world)
        assert (ps.rank, ps.world) == (rank, world)
        assert ps.shard(8, "x") == (rank * 8 // world, 8 // world)
        x = torch.arange(6, dtype=torch.float32).view(2, 3) + rank

        def step(t):
            return parallel.all_gather_last(parallel.all_reduce(t * 2, ps), ps)

        want = torch.cat([sum(2 * (x - rank + r) for r in range(world))] * world, dim=-1)
        torch.testing.assert_close(step(x), want, rtol=0, atol=0)
        compiled = torch.compile(step, backend="mlagraph_eager", fullgraph=True)
        torch.testing.assert_close(compiled(x), want, rtol=0, atol=0)


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_on_gloo(world):
    spawn_ranks(_worker, world, timeout=120)


def test_errors_without_process_group():
    assert parallel.parallel_state(1) is parallel.SINGLE
    with pytest.raises(ValueError, match="tensor_parallel_size=2: expected an initialized default process group"):
        parallel.parallel_state(2)
    with pytest.raises(ValueError, match="positive int"):
        parallel.parallel_state(0)


def test_indivisible_heads_and_experts_rejected():
    cfg = DeepseekConfig.from_hf(hf_config("v3"))  # 4 heads, 8 experts
    parallel.check_divisible(cfg, parallel.ParallelState(world=2, rank=1))
    with pytest.raises(ValueError, match=r"divisor of num_attention_heads \(4\), got 3"):
        parallel.check_divisible(cfg, parallel.ParallelState(world=3, rank=0))
    cfg6 = DeepseekConfig.from_hf(hf_config("v3").to_dict() | {"n_routed_experts": 6, "n_group": 2, "topk_group": 1})
    with pytest.raises(ValueError, match=r"divisor of n_routed_experts \(6\), got 4"):
        parallel.check_divisible(cfg6, parallel.ParallelState(world=4, rank=0))
