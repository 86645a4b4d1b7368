"""A job's processes under torch.distributed: who runs which bin (taken one at a time from the process group's
store, or split by tokens where there is none) and the few collectives the job uses (host objects over gloo)."""

from __future__ import annotations

import heapq
import logging
import os
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

__all__ = ["rank_shares", "init_distributed", "Ranks", "BinClaims"]

log = logging.getLogger("autoragged")


def rank_shares(bins: Sequence[Sequence[int]], lengths, world: int, align: int = 1) -> list[list[int]]:
    """Each rank's bins (indices into `bins`, ascending) for `world` ranks: bins by aligned tokens, largest first
    (ties: lower index), each to the rank with the fewest tokens so far (ties: lower rank). A function of its
    arguments alone, so every rank computes the same split without communicating; no rank ends more than one
    bin's tokens above the least loaded (largest-first greedy)."""
    if world < 1:
        raise ValueError(f"world must be a positive int, got {world}")
    lengths = np.asarray(lengths, dtype=np.int64)
    aligned = (lengths + (align - 1)) // align * align
    costs = [int(aligned[np.asarray(b, dtype=np.int64)].sum()) for b in bins]
    loads = [(0, r) for r in range(world)]
    shares: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, r = heapq.heappop(loads)
        shares[r].append(i)
        heapq.heappush(loads, (load + costs[i], r))
    return [sorted(s) for s in shares]


class BinClaims:
    """The bins a rank runs, taken one at a time, in order, from a counter every rank shares (the process group's
    key-value store): a rank takes the next bin when it has staged its last, so a rank slowed by its host or by
    costlier bins takes fewer, and all finish within about a bin of each other. Equal token shares (`rank_shares`)
    left ranks of a BERT-base embedding job 4-21% apart on four H200s. Every bin still runs exactly as in one
    process, so the results do not depend on which rank ran it; FFD's order puts the largest bins first."""

    def __init__(self, bins: Sequence[Sequence[int]], store, key: str):
        self.bins, self.store, self.key = bins, store, key

    def __iter__(self):
        while True:
            i = self.store.add(self.key, 1) - 1  # (atomic on the store: each index goes to one rank)
            if i >= len(self.bins):
                return
            yield self.bins[i]


def init_distributed() -> tuple[int, int]:
    """Initialise torch.distributed from torchrun's environment (WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT,
    LOCAL_RANK) where no process group is: gloo, plus NCCL for CUDA tensors where a GPU is visible (each rank
    then on cuda:LOCAL_RANK; the job's own collectives move host objects over gloo). Returns (rank, world size);
    (0, 1) without torchrun's variables, initialising nothing."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "WORLD_SIZE" not in os.environ or "MASTER_ADDR" not in os.environ:
        return 0, 1
    if not dist.is_available():
        raise RuntimeError("WORLD_SIZE is set but this PyTorch build has no torch.distributed")
    backend = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


_ENV_WARNED = False


class Ranks(NamedTuple):
    """This process's place among the job's processes, and the few collectives the job uses (host objects)."""

    rank: int
    world: int

    @staticmethod
    def current() -> Ranks:
        global _ENV_WARNED
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return Ranks(dist.get_rank(), dist.get_world_size())
        world = os.environ.get("WORLD_SIZE", "1")
        if world.isdigit() and int(world) > 1 and not _ENV_WARNED:
            _ENV_WARNED = True
            log.warning("run_job: WORLD_SIZE=%s but no process group: each process runs the whole job; call "
                        "autoragged.job.init_distributed() first to split it", world)  # fmt: skip
        return Ranks(0, 1)

    def all(self, obj) -> list:
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out

    def gather(self, obj) -> list | None:
        """Every rank's obj on rank 0 (a list by rank), None on the others."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world if self.rank == 0 else None
        torch.distributed.gather_object(obj, out, dst=0)
        return out

    def store(self):
        """The process group's key-value store (torchrun's rendezvous), or None where there is no group or its
        store cannot be reached (then shares are split by tokens, with no communication)."""
        if self.world == 1:
            return None
        try:
            from torch.distributed import distributed_c10d

            return distributed_c10d._get_default_store()
        except (AttributeError, RuntimeError, ValueError):  # (a private accessor: absent in another PyTorch)
            return None

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    def check_same(self, key) -> None:
        """Every rank's documents are rank 0's (their count and fingerprint), else a ValueError on every rank."""
        keys = self.all(key)
        bad = [r for r, k in enumerate(keys) if k != keys[0]]
        if bad:
            raise ValueError(
                f"rank {bad[0]} has other documents than rank 0 ({keys[bad[0]][0]} against {keys[0][0]} documents, "
                "or other token ids or output): every rank must call run_job with the same documents and output"
            )
