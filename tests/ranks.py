"""Spawned gloo ranks for the tensor-parallel tests: one place for the rendezvous and the join.

The ranks meet through a file in a temporary directory rather than a TCP port picked free in
advance, so nothing else (another test's ranks, gloo's own connections) can take the meeting
point between choosing it and using it.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import tempfile

import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def spawn_ranks(worker, world: int, *args, timeout: float = 600) -> None:
    """Runs ``worker(rank, world, init_method, *args)`` in ``world`` spawned processes and waits;
    a rank's exception is raised here."""
    os.environ["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    with tempfile.TemporaryDirectory() as tmp:
        init_method = "file://" + os.path.join(tmp, "rendezvous")
        ctx = mp.start_processes(worker, args=(world, init_method, *args), nprocs=world, join=False,
                                 start_method="spawn")
        while not ctx.join(timeout=timeout):
            pass


def join_gloo(rank: int, world: int, init_method: str, seconds: float = 240) -> None:
    """In a spawned rank: the default process group on gloo (collectives time out after ``seconds``)."""
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=seconds))


@contextlib.contextmanager
def gloo_group(rank: int, world: int, init_method: str, seconds: float = 240):
    """:func:`join_gloo` for the body; on the way out a barrier if the body succeeded, then
    ``destroy_process_group``. The barrier has every rank finish before any tears its group
    down: once in CI (2026-12-07) a rank aborted in gloo's C++ teardown ("terminate called
    without an active exception") while its peer was still closing. A failing body skips it,
    so the failure is raised at once rather than after a collective's timeout."""
    join_gloo(rank, world, init_method, seconds)
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()
