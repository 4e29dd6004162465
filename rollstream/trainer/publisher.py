"""The trainer's side of policy versions: after each committed batch, its step figures as
``Metric`` records on ``metrics`` and to this process's experiment trackers
(rollstream.observability.trackers), then the ``PolicyVersion`` it made on the compacted
``policy.versions`` topic (read by rollstream.policy.versions' watcher and followers)."""

from __future__ import annotations

from rollstream.kafka.clients import make_producer
from rollstream.kafka.cluster import Bootstrap
from rollstream.kafka.topics import Topics
from rollstream.observability.metrics import step_metrics
from rollstream.observability.trackers import process_trackers
from rollstream.policy.versions import POLICY_KEY
from rollstream.runtime import now_ms, worker_id
from rollstream.schemas import encode


class PolicyPublisher:
    """The trainer's side: publishes a PolicyVersion and waits for the broker's acknowledgement."""

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

    def publish_batch(self, entry: dict) -> dict:
        """What a committed manifest ``entry`` made: its step's Metric events on ``metrics``
        (``step_metrics``), the same figures handed to ``process_trackers()`` (which log them on
        threads of their own), then its policy version: the trainer report's, or (training off)
        one per batch with the initial weights. Raises ValueError for trained weights without a
        checkpoint (workers would stamp a version they do not have)."""
        records = step_metrics(entry, self.worker)
        for record in records:
            self.producer.send(self.topics.metrics, key=self.worker.encode(), value=encode(record, "Metric"))
        process_trackers().log_step(entry["step"], records)
        if "policy_version" in entry:
            if entry["policy_version"] > 0 and not entry.get("checkpoint"):
                raise ValueError(f"step {entry['step']}: policy version {entry['policy_version']} has no checkpoint "
                                 "to publish (give the PolicyTrainer a CheckpointStore)")
            return self.publish(entry["policy_version"], entry["step"], entry.get("checkpoint", ""),
                                not entry.get("skipped", False))
        return self.publish(entry["step"] + 1, entry["step"], "", False)

    def close(self) -> None:
        self.producer.close()
