"""What the trainer announces after each committed batch: its step figures (this process's
metrics, ``Metric`` records on ``metrics`` and the experiment trackers of
rollstream.observability.trackers), then the ``PolicyVersion`` it made on the compacted
``policy.versions`` topic (read by rollstream.policy.versions' watcher and followers).
rollstream.trainer.rollout_stream.RolloutStream calls both."""

from __future__ import annotations

from rollstream.kafka.clients import make_producer
from rollstream.kafka.cluster import Bootstrap
from rollstream.kafka.topics import Topics
from rollstream.observability.metrics import process_metrics, step_metrics
from rollstream.observability.trackers import process_trackers
from rollstream.policy.versions import POLICY_KEY
from rollstream.runtime import now_ms, worker_id
from rollstream.schemas import encode


def version_of(entry: dict) -> tuple[int, int, str, bool]:
    """``(version, step, checkpoint, trained)``, the ``PolicyPublisher.publish`` arguments of the
    version a committed manifest ``entry`` made: the trainer report's, or (training off) version
    ``step + 1`` untrained, the initial weights. Raises ValueError for trained weights without a
    checkpoint (workers would stamp a version they do not have)."""
    step = int(entry["step"])
    if "policy_version" not in entry:
        return step + 1, step, "", False
    version = int(entry["policy_version"])
    if version > 0 and not entry.get("checkpoint"):
        raise ValueError(f"step {step}: policy version {version} has no checkpoint to publish "
                         "(give the PolicyTrainer a CheckpointStore)")
    return version, step, entry.get("checkpoint", ""), not entry.get("skipped", False)


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


class PolicyPublisher:
    """The trainer's side: ``publish`` sends a PolicyVersion and waits for the broker's
    acknowledgement (the one way a version is published); ``publish_step`` a step's figures."""

    def __init__(self, bootstrap: Bootstrap, topics: Topics) -> None:
        self.topics = topics
        self.worker = worker_id("trainer")
        self.producer = make_producer(bootstrap, client_id=self.worker)

    def publish(self, version: int, step: int, checkpoint: str, trained: bool) -> dict:
        record = {"version": int(version), "step": int(step), "checkpoint": checkpoint, "trained": trained,
                  "worker": self.worker, "created_ms": now_ms()}
        self.producer.send(self.topics.policy_versions, key=POLICY_KEY, value=encode(record, "PolicyVersion"))
        self.producer.flush()
        return record

    def publish_step(self, entry: dict) -> None:
        """A committed manifest ``entry``'s figures: counted in this process's metrics
        (``record_batch_metrics``), its step's Metric events on ``metrics`` (``step_metrics``),
        and the same figures handed to ``process_trackers()`` (which log them on threads of
        their own)."""
        record_batch_metrics(entry)
        records = step_metrics(entry, self.worker)
        for record in records:
            self.producer.send(self.topics.metrics, key=self.worker.encode(), value=encode(record, "Metric"))
        process_trackers().log_step(entry["step"], records)

    def close(self) -> None:
        self.producer.close()
