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

from pathlib import Path
from typing import Callable

from typing import TYPE_CHECKING

from rollstream.config import Config
from rollstream.kafka.cluster import Bootstrap
from rollstream.trainer.distributed import process_group_from_env
from rollstream.trainer.loop import LoopControl, LoopResult, build_batches
from rollstream.trainer.rollout_stream import RolloutStream

if TYPE_CHECKING:  # model code (transformers) is imported only by a trainer that trains
    from rollstream.trainer.policy import PolicyTrainer

__all__ = ["LoopResult", "build_batches", "policy_trainer", "run_trainer"]


def policy_trainer(config: Config, checkpoint_dir: Path) -> PolicyTrainer | None:
    """The PolicyTrainer of ``config`` (loads the model; resumes from the newest checkpoint in
    ``checkpoint_dir``), or None when ``actor_train.enabled`` is off."""
    if not config.actor_train.enabled:
        return None
    from rollstream.trainer.checkpoint import CheckpointStore
    from rollstream.trainer.policy import PolicyTrainer

    return PolicyTrainer.from_config(config, CheckpointStore(checkpoint_dir, config.actor_train.keep_checkpoints))


def run_trainer(config: Config, bootstrap: Bootstrap, run_dir: Path, *, deadline: float | None = None,
                check: Callable[[], None] = lambda: None,
                on_progress: Callable[[LoopResult, int], None] = lambda result, buffered: None,
                should_stop: Callable[[], bool] = lambda: False) -> LoopResult:
    """Train on ``groups.accepted`` until ``max_steps`` batches exist (see
    rollstream.trainer.loop.BatchLoop for ``deadline``, ``check``, ``on_progress`` and
    ``should_stop``, which rank 0 evaluates). The manifest and checkpoints live under ``run_dir``;
    a restarted trainer resumes from them: a batch its checkpoint holds but the manifest does not
    (a crash in between) is recorded, not trained again. Under ``torchrun`` each rank runs this
    (module doc). Every client is closed on return; returns the same result on every rank."""
    # the ranks' backend follows the training device (nccl on CUDA); without training: gloo
    if config.actor_train.enabled:
        from rollstream.policy.model import resolve_device

        device = resolve_device(config.actor_train.device)
    else:
        device = "cpu"
    with process_group_from_env(device):
        trainer = policy_trainer(config, run_dir / "checkpoints")
        resume = None if trainer is None or trainer.resumed is None else {**trainer.resumed,
                                                                          "checkpoint": trainer.checkpoint}
        control = LoopControl(deadline=deadline, check=check, should_stop=should_stop, on_progress=on_progress)
        try:
            with RolloutStream.from_config(config, bootstrap, run_dir, resume=resume, control=control) as stream:
                deferred = trainer is not None and config.actor_train.async_save and not stream.ranks.distributed
                for batch in stream:
                    report = None if trainer is None else trainer.train(
                        batch.rollout, group_keys=batch.group_keys, policy_versions=batch.policy_versions,
                        defer_save=deferred)
                    if deferred:  # the previous batch is committed before this checkpoint can be durable
                        stream.settle()
                        batch.commit(report=report, durable=trainer.save_deferred())
                    else:
                        batch.commit(report=report)
        finally:
            if trainer is not None:
                trainer.close()
        return stream.result
