"""The verdicts that end a step short of a full batch, read from their event topics.

RLVR: the admission publishes ``Batch(status="underfilled")`` on ``batches`` when a step's
resampling budget is spent, and one ``Batch(status="end_of_data")`` once the prompts of the last
epoch are all decided. Agentic: every train group id publishes a ``GroupQueueOutcome`` on
``episodes.outcomes`` when it stops; once all have stopped and fewer than a batch of accepted
groups remain uncommitted, that is the verdict. Both readers return verdicts shaped like the
admission's ``Batch`` event; ``verdict_action`` applies ``min_fill_ratio``.
"""

from __future__ import annotations

from rollstream.kafka.cluster import Bootstrap
from rollstream.kafka.readback import Tail
from rollstream.kafka.topics import Topics


def underfill_action(accepted: int, target: int, min_fill_ratio: float) -> str:
    """``ship_partial`` or ``fail`` for a step that ended with ``accepted`` of ``target`` groups."""
    return "ship_partial" if accepted > 0 and accepted / target >= min_fill_ratio else "fail"


def verdict_action(verdict: dict, min_fill_ratio: float) -> str:
    """What the trainer does on a verdict (a ``Batch`` record of status ``underfilled`` or
    ``end_of_data``, with ``accepted_groups`` and ``target_groups``).

    ``ship_partial``: train the accepted groups as a partial batch (``accepted > 0`` and
    ``accepted / target >= min_fill_ratio``). Otherwise ``fail`` for ``underfilled`` (the run
    stops ``batch_underfilled``) and ``end`` for ``end_of_data`` (the run ends ``end_of_data``;
    the groups stay uncommitted in ``groups.accepted``). Raises ValueError for another status.
    """
    if verdict["status"] not in ("underfilled", "end_of_data"):
        raise ValueError(f"not a verdict: Batch status {verdict['status']!r}")
    action = underfill_action(verdict["accepted_groups"], verdict["target_groups"], min_fill_ratio)
    return "end" if action == "fail" and verdict["status"] == "end_of_data" else action


class BatchEvents(Tail):
    """Tails the ``batches`` topic for the admission's verdicts."""

    def __init__(self, bootstrap: Bootstrap, topics: Topics) -> None:
        super().__init__(bootstrap, topics.batches)

    def verdicts(self) -> list[dict]:
        """The ``underfilled`` and ``end_of_data`` Batch records that arrived since the last call,
        in topic order (the trainer's own ``complete``/``partial`` events are skipped)."""
        return [record for name, record in self.new()
                if name == "Batch" and record["status"] in ("underfilled", "end_of_data")]


class AgenticBatchEvents(Tail):
    """The agentic counterpart of ``BatchEvents``: the verdict comes from the group queues.

    Each train group id publishes one ``GroupQueueOutcome`` (status ``complete`` or ``exhausted``,
    its accepted and rejected episodes) on ``episodes.outcomes`` when it stops. Once every one has
    stopped, no further group can arrive; if fewer than a batch remain uncommitted, one
    ``underfilled`` verdict per step is returned, shaped like the admission's ``Batch`` event.
    """

    def __init__(self, bootstrap: Bootstrap, topics: Topics, config, builder) -> None:
        super().__init__(bootstrap, topics.episodes_outcomes)
        self.num_groups = config.train_env_manager.num_env_groups
        self.target = config.groups_per_batch
        self.builder = builder
        # train group id -> its outcome; a redelivered outcome replaces its first copy
        self.done: dict[int, dict] = {}
        self._verdict_step: int | None = None

    def verdicts(self) -> list[dict]:
        """At most one ``underfilled`` verdict per step (agentic runs have no end of data)."""
        for name, record in self.new():
            if name == "GroupQueueOutcome" and record["mode"] == "train":
                self.done[record["group_id"]] = record
        if len(self.done) < self.num_groups or self._verdict_step == self.builder.step:
            return []
        accepted = sum(outcome["accepted"] for outcome in self.done.values())
        # groups the builder dropped (stale, payload_expired, a bad payload) never reach a batch
        remaining = accepted - self.builder.committed_groups - self.builder.dropped_groups
        if remaining >= self.target:
            return []
        rejected: dict[str, int] = {}
        for outcome in self.done.values():
            for reason, count in outcome["rejected_by_reason"].items():
                rejected[reason] = rejected.get(reason, 0) + count
        self._verdict_step = self.builder.step
        return [{"step": self.builder.step, "status": "underfilled", "target_groups": self.target,
                 "accepted_groups": remaining,
                 "prompts_consumed": sum(outcome["episodes_decided"] for outcome in self.done.values()),
                 "rejected_by_reason": rejected}]
