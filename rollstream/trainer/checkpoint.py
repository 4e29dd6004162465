"""Durable trainer checkpoints: one folder per policy version.

``<root>/v000003/`` holds the weights as a Hugging Face model folder (``model.safetensors`` +
``config.json``, plus the tokenizer when given, so a generation worker or vLLM can load it by
path), ``optimizer.pt`` (the AdamW state, so a restarted trainer continues the same
optimisation) and ``trainer_state.json`` (version, step, the batch's group keys and its report).

A checkpoint is written to a hidden temporary folder, every file fsynced, then renamed into
place: a folder named ``v*`` is always complete. The trainer's exactly-once rule builds on that:
a batch is trained once its checkpoint folder exists, whatever happened to the offsets after.

The optimizer state of a pruned folder is kept as ``.spare-optimizer.pt`` and the next
checkpoint's is written over it in place: its pages stay in the page cache, where a new file's
must be allocated afresh (on this project's VMs, where freed memory goes back to the host, that
cost ~9 CPU-seconds per GB written). Only the trainer reads that file, at a restart; the weights,
which workers load while the trainer writes on, always go to a new file.

``CheckpointWriter`` takes the write off the training step's path: the caller copies the
weights and AdamW state into CPU memory (``snapshot``, ~0.5 s for 135M parameters against ~4.5 s
for the write), and a thread of its own writes the copy while the next step trains. The copy
is what makes that safe: the next step's optimiser update never reaches a file being written.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from rollstream.exceptions import RollstreamError

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.pt"
SPARE_OPTIMIZER = ".spare-optimizer.pt"  # a pruned folder's optimizer.pt, to be written over


def _fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            with path.open("rb") as fh:
                os.fsync(fh.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Snapshot:
    """A policy version's checkpoint content, copied off the live model: ``weights`` (name ->
    CPU tensor, the model's ``state_dict``), ``optimizer`` (AdamW's ``state_dict`` with every
    tensor copied; None without an optimiser) and the trainer ``state`` (JSON-able)."""

    version: int
    weights: dict[str, torch.Tensor]
    optimizer: dict | None
    state: dict
    seconds: float  # how long the copy took (on the caller's path)


def snapshot(version: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
             state: dict) -> Snapshot:
    """Copy ``model``'s weights and ``optimizer``'s state to CPU memory (peak memory: one more
    model plus its AdamW moments), so they can be written while training goes on."""
    started = time.perf_counter()

    def copied(value):
        return value.detach().to("cpu", copy=True) if torch.is_tensor(value) else copy.deepcopy(value)

    # tied weights (lm_head = embed_tokens) stay one tensor: save_pretrained then writes them
    # once, as it does for the live model (SmolLM2-135M: 113 MB less per checkpoint)
    by_storage: dict[tuple, torch.Tensor] = {}
    weights = {}
    for name, tensor in model.state_dict().items():
        alias = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
        if alias not in by_storage:
            by_storage[alias] = copied(tensor)
        weights[name] = by_storage[alias]
    opt = None
    if optimizer is not None:
        full = optimizer.state_dict()
        opt = {"state": {k: {n: copied(v) for n, v in s.items()} for k, s in full["state"].items()},
               "param_groups": copy.deepcopy(full["param_groups"])}
    return Snapshot(version, weights, opt, dict(state), time.perf_counter() - started)


class CheckpointStore:
    """Versioned checkpoints under ``root``; keeps the newest ``keep_last`` folders, and with
    ``keep_every`` also the weights of every version divisible by it (their optimizer state
    goes), to evaluate a run's versions afterwards. The folders are published by path, so
    ``root`` must be on a filesystem every worker sees (a shared volume in docker-compose:
    ``./runs``).

    Raises ValueError for ``keep_last`` or ``keep_every`` < 1.
    """

    def __init__(self, root: str | os.PathLike, keep_last: int = 2, keep_every: int | None = None) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        if keep_every is not None and keep_every < 1:
            raise ValueError(f"keep_every must be >= 1, got {keep_every}")
        self.root = Path(root).absolute()  # published to other processes: never relative to our cwd
        self.keep_last = keep_last
        self.keep_every = keep_every

    def path_of(self, version: int) -> Path:
        return self.root / f"v{version:06d}"

    def save(self, version: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
             state: dict, tokenizer=None) -> Path:
        """Write checkpoint ``version`` atomically and return its folder. ``state`` (JSON-able)
        is stored with ``version`` added. An existing folder of the same version (written before
        a crash, then trained again from the previous one) is replaced.

        Raises RollstreamError (``checkpoint_not_written``, with the cause chained and the free
        space of the disk) when a file cannot be written, a full disk say; the partial folder is
        removed first, so a failed save costs no disk and leaves the previous checkpoints as
        they were."""
        return self._write(version, model, None, optimizer.state_dict() if optimizer is not None else None,
                           state, tokenizer)

    def write(self, snap: Snapshot, model: torch.nn.Module, tokenizer=None) -> Path:
        """``save`` of a ``Snapshot`` (``model`` gives only its config and the names of tied
        weights, so it may be training meanwhile). Raises as ``save``."""
        return self._write(snap.version, model, snap.weights, snap.optimizer, snap.state, tokenizer)

    def _write(self, version: int, model: torch.nn.Module, weights: dict | None, optimizer_state: dict | None,
               state: dict, tokenizer) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.path_of(version)
        tmp = self.root / f".{final.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            model.save_pretrained(tmp, state_dict=weights, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            if optimizer_state is not None:
                self._save_optimizer(optimizer_state, tmp / OPTIMIZER_FILE)
            (tmp / STATE_FILE).write_text(json.dumps({**state, "version": version}, sort_keys=True))
            _fsync_tree(tmp)
        except Exception as err:  # safetensors and torch wrap the OSError in errors of their own
            shutil.rmtree(tmp, ignore_errors=True)
            free_gib = shutil.disk_usage(self.root).free / 2**30
            raise RollstreamError(f"checkpoint_not_written: {final} ({free_gib:.1f} GiB free on its disk): "
                                  f"{type(err).__name__}: {err}") from err
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(self.root)
        self._prune()
        return final

    def _save_optimizer(self, optimizer_state: dict, path: Path) -> None:
        """torch.save ``optimizer_state`` to ``path``, over the spare file's bytes when there is
        one (module doc)."""
        spare = self.root / SPARE_OPTIMIZER
        try:
            os.replace(spare, path)
        except FileNotFoundError:
            path.touch()
        with path.open("r+b") as fh:
            torch.save(optimizer_state, fh)
            fh.truncate()

    def versions(self) -> list[int]:
        """Versions with a complete folder, oldest first."""
        if not self.root.is_dir():
            return []
        out = []
        for path in self.root.glob("v*"):
            if path.is_dir() and (path / STATE_FILE).is_file() and path.name[1:].isdigit():
                out.append(int(path.name[1:]))
        return sorted(out)

    def latest(self) -> tuple[Path, dict] | None:
        """(folder, trainer state) of the newest complete checkpoint, or None."""
        versions = self.versions()
        if not versions:
            return None
        path = self.path_of(versions[-1])
        return path, json.loads((path / STATE_FILE).read_text())

    def restore(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
        """Load the checkpoint at ``path`` into ``model`` (and ``optimizer`` when it was saved);
        returns its trainer state. Raises FileNotFoundError or RollstreamError (weights that do
        not fit the model)."""
        from rollstream.policy.model import load_weights_into  # model code: only a trainer that trains

        load_weights_into(model, path)
        if optimizer is not None and (path / OPTIMIZER_FILE).is_file():
            device = next(model.parameters()).device
            optimizer.load_state_dict(torch.load(path / OPTIMIZER_FILE, map_location=device, weights_only=True))
        return json.loads((path / STATE_FILE).read_text())

    def _prune(self) -> None:
        for version in self.versions()[:-self.keep_last]:
            folder = self.path_of(version)
            if self.keep_every and version % self.keep_every == 0:  # kept for its weights
                self._release_optimizer(folder)
                continue
            (folder / STATE_FILE).unlink(missing_ok=True)  # incomplete from here on
            self._release_optimizer(folder)
            shutil.rmtree(folder, ignore_errors=True)
        for stale in self.root.glob(".v*.tmp-*"):  # left by a crash mid-save
            if not stale.name.endswith(f"-{os.getpid()}"):
                shutil.rmtree(stale, ignore_errors=True)

    def _release_optimizer(self, folder: Path) -> None:
        """Drop ``folder``'s optimizer state; its file becomes the spare when there is none."""
        spare, optimizer = self.root / SPARE_OPTIMIZER, folder / OPTIMIZER_FILE
        if not optimizer.is_file():
            return
        if spare.exists():
            optimizer.unlink()
        else:
            os.replace(optimizer, spare)


class CheckpointWriter:
    """Writes ``Snapshot``s into ``store`` on a thread of its own, one at a time, in order.

    ``submit`` returns a Future of the folder; it raises (from ``result()``) what
    ``CheckpointStore.write`` raised. ``close`` waits for the writes submitted.
    """

    def __init__(self, store: CheckpointStore) -> None:
        self.store = store
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")

    def submit(self, snap: Snapshot, model: torch.nn.Module, tokenizer=None) -> Future:
        return self._pool.submit(self.store.write, snap, model, tokenizer)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
