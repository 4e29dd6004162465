"""Data-parallel training ranks under ``torch.distributed``: who consumes, who gets which rows, and
how a step's gradients and figures are summed over the ranks.

Rank 0 alone reads Kafka and commits (``rollstream.trainer.rollout_stream.RolloutStream``); each batch is cut
into one shard per rank by whole groups (``shard_ranges``: contiguous, sizes differing by at most
one, so a group's responses never straddle two ranks) and scattered. A rank whose shard is empty
(fewer groups than ranks) still takes part in every collective: it contributes zero gradients and
zero counts.

Loss aggregation stays exact: a rank's loss is divided by the whole batch's normaliser (valid
tokens for ``token-mean``, rows with a valid token for ``seq-mean-token-mean``, summed over the
ranks first) and the gradients are summed, not averaged, over the ranks; the sum is then the
single-process gradient of the whole batch (``rollstream.trainer.grpo.train_step``).

Without an initialised process group (or with one rank) ``Ranks`` is rank 0 of 1 and every
collective is the identity, so the same code serves a single process.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from rollstream.trainer.batch import RolloutBatch


def shard_ranges(num_groups: int, world_size: int) -> list[tuple[int, int]]:
    """``world_size`` contiguous ``[start, end)`` ranges of group indices covering
    ``range(num_groups)``; sizes differ by at most one, the lower ranks take the extra groups, and
    a rank gets an empty range when there are fewer groups than ranks.

    Raises:
        ValueError: ``num_groups`` < 0 or ``world_size`` < 1.
    """
    if num_groups < 0 or world_size < 1:
        raise ValueError(f"need num_groups >= 0 and world_size >= 1, got {num_groups}, {world_size}")
    base, extra = divmod(num_groups, world_size)
    out, start = [], 0
    for rank in range(world_size):
        end = start + base + (1 if rank < extra else 0)
        out.append((start, end))
        start = end
    return out


def group_shard(batch: RolloutBatch, start: int, end: int) -> RolloutBatch:
    """The rows of groups ``[start, end)`` of ``batch`` as a RolloutBatch of their own: every
    tensor and per-row list sliced, ``group_keys`` cut to those groups and ``group_index``
    renumbered from 0; widths (P, T) and ``step`` unchanged. Rows of one group are contiguous
    (``build_batch`` orders them by group), so this is one slice. ``start == end`` gives an empty
    shard (``B == 0``) of the same widths.

    Raises:
        ValueError: the range is not inside ``[0, batch.num_groups]``.
    """
    if not 0 <= start <= end <= batch.num_groups:
        raise ValueError(f"group range [{start}, {end}) is not inside the batch's {batch.num_groups} groups")
    index = batch.group_index
    rows = slice(int((index < start).sum()), int((index < end).sum()))
    per_row = ("prompt_ids_str", "sample_index", "policy_versions")
    out = {}
    for f in fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, Tensor) or f.name in per_row:
            value = value[rows]
        out[f.name] = value
    out["group_index"] = index[rows] - start
    out["group_keys"] = batch.group_keys[start:end]
    out["extras"] = {name: t[rows] for name, t in batch.extras.items()}
    return RolloutBatch(**out)


def shard_batch(batch: RolloutBatch, world_size: int) -> list[RolloutBatch]:
    """One ``group_shard`` per rank, by ``shard_ranges``; together they hold every row once."""
    return [group_shard(batch, start, end) for start, end in shard_ranges(batch.num_groups, world_size)]


@dataclass(frozen=True)
class Ranks:
    """This process's place among the training ranks, and the collectives the trainer needs.

    ``rank`` / ``world_size`` come from the default process group (``Ranks.current()``); with
    ``world_size == 1`` every method is the identity (no process group needed).
    """

    rank: int = 0
    world_size: int = 1

    @classmethod
    def current(cls) -> "Ranks":
        """The default process group's rank and size; rank 0 of 1 when none is initialised."""
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that consumes, commits, checkpoints and publishes."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def scatter(self, objects: Sequence[object] | None) -> object:
        """Rank 0 passes one picklable object per rank; every rank returns its own. Other ranks
        pass None."""
        if not self.distributed:
            return objects[0]
        out: list[object] = [None]
        dist.scatter_object_list(out, list(objects) if self.is_main else None, src=0)
        return out[0]

    def broadcast(self, obj: object) -> object:
        """Rank 0's ``obj`` on every rank (picklable)."""
        if not self.distributed:
            return obj
        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def sum(self, values: Sequence[float], device: torch.device | str = "cpu") -> list[float]:
        """Each value summed over the ranks (float64; one all-reduce for all of them)."""
        if not self.distributed:
            return [float(v) for v in values]
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.tolist()

    def sum_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Sum every parameter's ``.grad`` over the ranks, in place. Every rank passes the same
        parameters in the same order; a parameter without a gradient here (an empty shard, a
        branch the shard did not use) contributes zeros, so no rank skips a collective."""
        if not self.distributed:
            return
        grads = []
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        if not grads:
            return
        # one flat buffer per dtype: a handful of all-reduces instead of one per parameter
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for group in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in group])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            offset = 0
            for g in group:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()


@contextmanager
def process_group_from_env(device: str = "cpu") -> Iterator[Ranks]:
    """The training ranks ``torchrun`` describes: with ``WORLD_SIZE`` > 1 in the environment and
    no process group yet, join one for the block (``nccl`` for a CUDA ``device``, each rank on
    ``cuda:LOCAL_RANK``; ``gloo`` otherwise) and leave it after. A plain process (no
    ``WORLD_SIZE``) or an already initialised group is used as it is."""
    create = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized()
    if create:
        cuda = device.startswith("cuda")
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo")
    try:
        yield Ranks.current()
    finally:
        if create:
            dist.destroy_process_group()
