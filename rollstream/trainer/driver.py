"""The trainer driver, one for `rollstream run` and `rollstream worker trainer`: accepted groups ->
batches -> (old_log_probs, correction masks, GRPO step, checkpoint) -> commit -> policy version,
until ``max_steps`` batches exist in total, or a verdict, a deadline or a stop ends the run.

rollstream's own GRPO trainer is one client of the public own-trainer API
(``rollstream.trainer.rollout_stream.RolloutStream``): the same batches, verdict handling
(rollstream.trainer.loop: underfilled -> partial batch or ``batch_underfilled`` per
``min_fill_ratio``; ``end_of_data`` -> a final partial batch marked ``end_of_data`` or none, then
outcome ``end_of_data`` at once), commits and policy versions as a user's own loop.

Data-parallel: started under ``torchrun --nproc_per_node N`` (``rollstream worker trainer``),
every rank loads the model and resumes from the same checkpoint; rank 0 consumes and commits,
each rank trains on its shard of every batch, gradients are summed over the ranks so the step
is the single-process step of the whole batch (rollstream.trainer.distributed), and rank 0
writes the checkpoint and publishes the policy version.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from rollstream.config import Config
from rollstream.kafka.cluster import Bootstrap
from rollstream.trainer.distributed import process_group_from_env
from rollstream.trainer.loop import LoopControl, LoopResult
from rollstream.trainer.rollout_stream import RolloutStream

if TYPE_CHECKING:  # model code (transformers) is imported only by a trainer that trains
    from rollstream.trainer.policy_trainer import PolicyTrainer

__all__ = ["LoopResult", "TrainerLoader", "policy_trainer", "run_trainer"]


def policy_trainer(config: Config, checkpoint_dir: Path) -> PolicyTrainer | None:
    """The PolicyTrainer of ``config`` (loads the model; resumes from the newest checkpoint in
    ``checkpoint_dir``), or None when ``actor_train.enabled`` is off."""
    if not config.actor_train.enabled:
        return None
    from rollstream.trainer.policy_trainer import PolicyTrainer

    return PolicyTrainer.from_config(config, _checkpoints(config, checkpoint_dir))


def _checkpoints(config: Config, checkpoint_dir: Path):
    from rollstream.trainer.checkpoint import CheckpointStore

    return CheckpointStore(checkpoint_dir, config.actor_train.keep_checkpoints, config.actor_train.keep_checkpoint_every)


class TrainerLoader:
    """The PolicyTrainer of ``config``, loaded on a thread of its own once ``ready()`` holds
    (polled every ``POLL_S``), so that loading the model (~10 CPU-s of imports and weights) does
    not compete with the pipeline's start: `rollstream run` waits for the first response, and
    the first batch takes longer to fill than the load. ``ready=None`` loads at once, in the
    caller's thread. ``resume`` (the newest checkpoint's trainer state and folder, or None) is
    read without the model."""

    POLL_S = 0.5

    def __init__(self, config: Config, checkpoint_dir: Path, ready: Callable[[], bool] | None = None) -> None:
        self.resume = None
        self._stop = threading.Event()  # closed before the load: load nothing
        self._now = threading.Event()  # wait no longer for ``ready``
        self._future: Future | None = None
        self._pool: ThreadPoolExecutor | None = None
        if not config.actor_train.enabled:
            return
        latest = _checkpoints(config, checkpoint_dir).latest()
        if latest is not None:
            self.resume = {**latest[1], "checkpoint": str(latest[0])}
        if ready is None:
            self._future = Future()
            self._future.set_result(policy_trainer(config, checkpoint_dir))
            return
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer-load")
        self._future = self._pool.submit(self._load, config, checkpoint_dir, ready)

    def _load(self, config: Config, checkpoint_dir: Path, ready: Callable[[], bool]) -> PolicyTrainer | None:
        while not self._now.is_set() and not ready():
            self._now.wait(self.POLL_S)
        return None if self._stop.is_set() else policy_trainer(config, checkpoint_dir)

    def trainer(self) -> PolicyTrainer | None:
        """The loaded trainer (waits for the load, which starts now if ``ready`` has not held
        yet); None when training is off, or after ``close`` came first. Raises what the load
        raised (ConfigError for weights that cannot be loaded)."""
        if self._future is None:
            return None
        self._now.set()
        return self._future.result()

    def close(self) -> None:
        """Stop waiting for ``ready``; close the loaded trainer (its checkpoint writes finish)."""
        self._stop.set()
        self._now.set()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self._future is not None and self._future.done() and self._future.exception() is None:
            if (trainer := self._future.result()) is not None:
                trainer.close()


def run_trainer(config: Config, bootstrap: Bootstrap, run_dir: Path, *, deadline: float | None = None,
                check: Callable[[], None] = lambda: None,
                on_progress: Callable[[LoopResult, int], None] = lambda result, buffered: None,
                should_stop: Callable[[], bool] = lambda: False,
                load_when: Callable[[], bool] | None = None) -> LoopResult:
    """Train on ``groups.accepted`` until ``max_steps`` batches exist (see
    rollstream.trainer.loop.BatchLoop for ``deadline``, ``check``, ``on_progress`` and
    ``should_stop``, which rank 0 evaluates). The manifest and checkpoints live under ``run_dir``;
    a restarted trainer resumes from them: a batch its checkpoint holds but the manifest does not
    (a crash in between) is recorded, not trained again. ``load_when``: load the model on a
    thread once it holds (``TrainerLoader``; one process only), else at once. Under ``torchrun``
    each rank runs this (module doc). Every client is closed on return; returns the same result
    on every rank."""
    # the ranks' backend follows the training device (nccl on CUDA); without training: gloo
    if config.actor_train.enabled:
        from rollstream.policy.model import resolve_device

        device = resolve_device(config.actor_train.device)
    else:
        device = "cpu"
    with process_group_from_env(device) as ranks:
        loader = TrainerLoader(config, run_dir / "checkpoints", None if ranks.distributed else load_when)
        control = LoopControl(deadline=deadline, check=check, should_stop=should_stop, on_progress=on_progress)
        try:
            with RolloutStream.from_config(config, bootstrap, run_dir, resume=loader.resume,
                                           control=control) as stream:
                deferred = config.actor_train.async_save and not ranks.distributed
                for batch in stream:
                    trainer = loader.trainer()
                    report = None if trainer is None else trainer.train(
                        batch.rollout, group_keys=batch.group_keys, policy_versions=batch.policy_versions,
                        defer_save=deferred)
                    if trainer is not None and deferred:  # the previous batch is committed before this
                        stream.settle()                   # checkpoint can become durable
                        batch.commit(report=report, durable=trainer.save_deferred())
                    else:
                        batch.commit(report=report)
        finally:
            loader.close()
        return stream.result
