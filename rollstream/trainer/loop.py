"""The trainer's consume loop: build ``max_steps`` batches, or stop on an underfilled verdict.

Shared by `rollstream run` (in-process, with a progress bar) and `rollstream worker trainer`.
The admission publishes ``Batch(status="underfilled")`` when the resampling budget of a step is
spent; the configured ``min_fill_ratio`` then decides (peer scenario 1):

* ``accepted / target >= min_fill_ratio`` -> ship the accepted groups as a partial batch;
* otherwise -> stop with outcome ``batch_underfilled``; the accepted groups stay uncommitted in
  ``groups.accepted`` (never lost) for a later run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from kafka import KafkaConsumer

from rollstream.exceptions import RollstreamError
from rollstream.kafka.topics import Topics
from rollstream.observability.metrics import process_metrics
from rollstream.schemas import decode


def underfill_action(accepted: int, target: int, min_fill_ratio: float) -> str:
    """``ship_partial`` or ``fail`` for a step that ended with ``accepted`` of ``target`` groups."""
    return "ship_partial" if accepted > 0 and accepted / target >= min_fill_ratio else "fail"


@dataclass
class LoopResult:
    outcome: str = "complete"  # complete | batch_underfilled | timed_out | stopped
    detail: str = ""
    batches: list[dict] = field(default_factory=list)  # manifest entries


class _Tail:
    """Reads a topic from its start without a consumer group; ``new()`` returns the decodable
    events that arrived since the last call, without waiting."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.consumer = KafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=None,
                                      auto_offset_reset="earliest", enable_auto_commit=False)

    def new(self) -> list[tuple[str, dict]]:
        out = []
        for msgs in self.consumer.poll(timeout_ms=0).values():
            for m in msgs:
                try:
                    out.append(decode(m.value))
                except RollstreamError:
                    continue
        return out

    def close(self) -> None:
        self.consumer.close()


class BatchEvents(_Tail):
    """Tails the ``batches`` topic for the admission's underfilled verdicts."""

    def __init__(self, bootstrap: str, topics: Topics) -> None:
        super().__init__(bootstrap, topics.batches)

    def underfilled(self) -> list[dict]:
        return [record for name, record in self.new() if name == "Batch" and record["status"] == "underfilled"]


class AgenticBatchEvents(_Tail):
    """The agentic counterpart of ``BatchEvents``: the verdict comes from the group queues.

    Each train group id reports ``group_queue/done`` (status ``complete`` or ``exhausted``, value =
    its accepted episodes) on ``metrics`` when it stops. Once every one has stopped, no further
    group can arrive; if fewer than a batch remain uncommitted, one ``underfilled`` verdict per
    step is returned, shaped like the admission's ``Batch`` event.
    """

    def __init__(self, bootstrap: str, topics: Topics, config, builder) -> None:
        super().__init__(bootstrap, topics.metrics)
        self.num_groups = config.train_env_manager.num_env_groups
        self.target = config.groups_per_batch
        self.builder = builder
        self.done: dict[str, float] = {}  # train group id -> accepted episodes
        self.rejected: dict[str, int] = {}
        self.episodes = 0
        self._verdict_step: int | None = None

    def underfilled(self) -> list[dict]:
        for name, record in self.new():
            if name != "Metric" or record["labels"].get("mode") != "train":
                continue
            if record["name"] == "group_queue/done":
                self.done[record["labels"]["group_id"]] = record["value"]
            elif record["name"] == "group_queue/groups":
                self.episodes += 1
                reason = record["labels"].get("reason", "")
                if reason != "accepted":
                    self.rejected[reason] = self.rejected.get(reason, 0) + 1
        if len(self.done) < self.num_groups or self._verdict_step == self.builder.step:
            return []
        remaining = int(sum(self.done.values())) - self.builder.committed_groups - self.builder.stale_groups
        if remaining >= self.target:
            return []
        self._verdict_step = self.builder.step
        return [{"step": self.builder.step, "status": "underfilled", "target_groups": self.target,
                 "accepted_groups": remaining, "prompts_consumed": self.episodes,
                 "rejected_by_reason": dict(self.rejected)}]



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


def build_batches(builder, events: BatchEvents, *, max_steps: int, min_fill_ratio: float,
                  deadline: float | None = None, check: Callable[[], None] = lambda: None,
                  on_progress: Callable[[LoopResult, int], None] = lambda result, buffered: None,
                  should_stop: Callable[[], bool] = lambda: False,
                  train: Callable[[object], dict] | None = None,
                  publish: Callable[[dict], object] = lambda entry: None) -> LoopResult:
    """Run until the builder's step reaches ``max_steps`` (batches committed in total, a restarted
    trainer's earlier ones included) or the loop must end (see module doc).

    ``builder`` is a rollstream.trainer.consumer.BatchBuilder; ``check`` raises when a stage
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
