"""The trainer driver, one for `rollstream run` and `rollstream worker trainer`: accepted groups ->
batches -> (old_log_probs, correction masks, GRPO step, checkpoint) -> commit -> policy version,
until ``max_steps`` batches exist in total, or a verdict, a deadline or a stop ends the run.

On an underfilled verdict (rollstream.trainer.verdicts) the configured ``min_fill_ratio``
decides (peer scenario 1):

* ``accepted / target >= min_fill_ratio`` -> ship the accepted groups as a partial batch;
* otherwise -> stop with outcome ``batch_underfilled``; the accepted groups stay uncommitted in
  ``groups.accepted`` (never lost) for a later run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from rollstream.config import AgenticConfig, Config
from rollstream.kafka import names
from rollstream.kafka.topics import Topics
from rollstream.observability.metrics import process_metrics
from rollstream.trainer.checkpoint import CheckpointStore
from rollstream.trainer.consumer import BatchBuilder
from rollstream.trainer.policy import PolicyTrainer, TrainSettings
from rollstream.trainer.publisher import PolicyPublisher
from rollstream.trainer.verdicts import AgenticBatchEvents, BatchEvents, underfill_action


@dataclass
class LoopResult:
    """How a trainer run ended and the manifest entries of the batches it committed."""

    outcome: str = "complete"  # complete | batch_underfilled | timed_out | stopped
    detail: str = ""
    batches: list[dict] = field(default_factory=list)  # manifest entries


def record_batch_metrics(entry: dict) -> None:
    """A committed batch in this process's metrics: its groups (unit ``trainer``; the stale
    ones are counted where BatchBuilder rejects them), its fill time, and its tokens kept or
    masked by the train-inference correction (unit ``token``)."""
    metrics = process_metrics()
    metrics.decided.labels("trainer", "accepted").inc(entry["accepted_groups"])
    metrics.batch_fill.observe(entry["fill_seconds"])
    if "tokens_valid" in entry:
        masked = entry["tokens_valid"] - entry["tokens_kept"]
        metrics.decided.labels("token", "accepted").inc(entry["tokens_kept"])
        metrics.decided.labels("token", "rejected").inc(masked)
        metrics.rejections.labels("token", "train_infer_correction").inc(masked)


def build_batches(builder: BatchBuilder, events: BatchEvents | AgenticBatchEvents, *, max_steps: int, min_fill_ratio: float,
                  deadline: float | None = None, check: Callable[[], None] = lambda: None,
                  on_progress: Callable[[LoopResult, int], None] = lambda result, buffered: None,
                  should_stop: Callable[[], bool] = lambda: False,
                  train: Callable[[object], dict] | None = None,
                  publish: Callable[[dict], object] = lambda entry: None) -> LoopResult:
    """Run until the builder's step reaches ``max_steps`` (batches committed in total, a restarted
    trainer's earlier ones included) or the loop must end (see module doc).

    ``check`` raises when a stage
    died; ``on_progress(result, buffered_groups)`` is called after every poll; ``train(batch)``
    (a PolicyTrainer's) runs before the batch is committed, and its report joins the manifest
    entry, so a batch counts as done only once it was trained (and checkpointed);
    ``publish(entry)`` then announces the policy version the batch made (PolicyPublisher).
    """
    result = LoopResult()
    while builder.step < max_steps:
        check()
        if should_stop():
            result.outcome = "stopped"
            break
        if deadline is not None and time.monotonic() > deadline:
            result.outcome, result.detail = "timed_out", "time limit reached"
            break
        batch = builder.next_batch(timeout_s=1.0)
        if batch is None:
            for event in events.underfilled():
                action = underfill_action(event["accepted_groups"], event["target_groups"], min_fill_ratio)
                if action == "ship_partial":
                    # the accepted groups precede the verdict on the topics; wait until they are read
                    batch = builder.take_partial(timeout_s=30.0, min_groups=event["accepted_groups"])
                else:
                    result.outcome = "batch_underfilled"
                    result.detail = (
                        f"step {event['step']}: {event['accepted_groups']}/{event['target_groups']} groups after "
                        f"{event['prompts_consumed']} prompts (min_fill_ratio {min_fill_ratio}); "
                        f"rejected: {event['rejected_by_reason']}")
        if batch is not None:
            entry = builder.commit(batch, train(batch) if train is not None else None)
            result.batches.append(entry)
            record_batch_metrics(entry)
            publish(entry)
        on_progress(result, builder.buffered)
        if result.outcome != "complete":
            break
    return result


def policy_trainer(config: Config, checkpoint_dir: Path) -> PolicyTrainer | None:
    """The PolicyTrainer of ``config`` (loads the model; resumes from the newest checkpoint in
    ``checkpoint_dir``), or None when ``actor_train.enabled`` is off."""
    if not config.actor_train.enabled:
        return None
    return PolicyTrainer(TrainSettings.from_config(config.actor_train), config.train_infer_correction,
                         checkpoints=CheckpointStore(checkpoint_dir, config.actor_train.keep_checkpoints))


def start_training(config: Config, bootstrap: str, builder: BatchBuilder,
                   run_dir: Path) -> tuple[PolicyTrainer | None, PolicyPublisher]:
    """The trainer side of a run: returns ``(trainer, publisher)``.

    The PolicyTrainer (None with training off) resumes from ``run_dir/checkpoints``; a batch a
    crash left trained but uncommitted is recorded in the builder (BatchBuilder.recover); the
    current policy version is published, so workers and the admission start from it.
    """
    trainer = policy_trainer(config, run_dir / "checkpoints")
    if trainer is not None and trainer.resumed is not None:
        builder.recover(trainer.resumed)
    publisher = PolicyPublisher(bootstrap, Topics(config.kafka.topic_prefix))
    if trainer is not None:
        publisher.publish(trainer.policy_version, builder.step - 1, trainer.checkpoint, trainer.policy_version > 0)
    else:
        publisher.publish(builder.step, builder.step - 1, "", False)
    return trainer, publisher


def run_trainer(config: Config, bootstrap: str, run_dir: Path, *, deadline: float | None = None,
                check: Callable[[], None] = lambda: None,
                on_progress: Callable[[LoopResult, int], None] = lambda result, buffered: None,
                should_stop: Callable[[], bool] = lambda: False) -> LoopResult:
    """Train on ``groups.accepted`` until ``max_steps`` batches exist (see build_batches for
    ``deadline``, ``check``, ``on_progress`` and ``should_stop``). The manifest and checkpoints
    live under ``run_dir``; a restarted trainer resumes from them. Every client is closed on
    return."""
    topics = Topics(config.kafka.topic_prefix)
    builder = BatchBuilder(bootstrap, topics, config.groups_per_batch, group_id=names.consumer_group(topics, "trainer"),
                           manifest_path=run_dir / "batches.jsonl", max_staleness=config.max_staleness,
                           max_message_bytes=config.kafka.max_message_bytes)
    events = (AgenticBatchEvents(bootstrap, topics, config, builder) if isinstance(config, AgenticConfig)
              else BatchEvents(bootstrap, topics))
    publisher = None
    try:
        trainer, publisher = start_training(config, bootstrap, builder, run_dir)
        return build_batches(builder, events, max_steps=config.max_steps, min_fill_ratio=config.min_fill_ratio,
                             deadline=deadline, check=check, on_progress=on_progress, should_stop=should_stop,
                             train=trainer.train if trainer is not None else None,
                             publish=publisher.publish_batch)
    finally:
        events.close()
        builder.close()
        if publisher is not None:
            publisher.close()
