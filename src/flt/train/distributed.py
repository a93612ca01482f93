"""Process-group setup from the ``torchrun`` environment, and the few collectives the loop uses.

``torchrun --nproc_per_node W ...`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT``; with ``WORLD_SIZE > 1`` the loop joins the group
(``gloo`` on CPU, ``nccl`` on CUDA) and wraps the model in DistributedDataParallel.
Without those variables everything here is a no-op for a single process.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Context:
    """Where this process runs: ``rank`` of ``world`` processes, on ``device``."""

    rank: int
    world: int
    device: torch.device
    owns_group: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(name: str) -> torch.device:
    """``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"`` or ``"cuda:K"``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:K]', got {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but CUDA is not available")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:K]', got {name!r}")
    return device


def setup(device: str = "auto") -> Context:
    """Join the process group if launched by ``torchrun`` with several processes."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dev = resolve_device(device)
    if world <= 1:
        return Context(0, 1, dev)
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if dev.type == "cuda":
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return Context(rank, world, dev, owns_group=owns)


def teardown(ctx: Context) -> None:
    if ctx.owns_group and dist.is_initialized():
        # DistributedDataParallel sits in reference cycles and holds the group: free it now,
        # in every process, so that the group's threads are not torn down later, at
        # interpreter exit (where gloo could abort a process after a finished run).
        gc.collect()
        dist.destroy_process_group()


def barrier(ctx: Context) -> None:
    if ctx.world > 1:
        dist.barrier()


def all_reduce_sum(ctx: Context, values: list[float]) -> list[float]:
    """Sum a list of floats over processes (in float64)."""
    if ctx.world == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t)
    return t.tolist()


_T = TypeVar("_T")


def all_gather(ctx: Context, obj: _T) -> list[_T]:
    """Every process's ``obj``, in rank order."""
    if ctx.world == 1:
        return [obj]
    out: list[Any] = [None] * ctx.world
    dist.all_gather_object(out, obj)
    return out


def all_equal(ctx: Context, value: str) -> bool:
    """True if every process holds the same string (e.g. a configuration digest)."""
    return len(set(all_gather(ctx, value))) == 1
