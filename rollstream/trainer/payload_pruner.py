"""The trainer's payload deletion (Kafka's DeleteRecords), the shell of
``rollstream.trainer.retention``: the partitions' log start offsets move up, and the broker frees
the segments below them at its next retention check (``log.retention.check.interval.ms``).

A thread of its own checks every ``every_s`` whether the readers are current (the timestamp of
each reader partition's oldest unread record: the record at the consumer group's committed
offset); the trainer calls ``prune`` after a commit with the references of the groups it holds.
Each side has its own Kafka clients (kafka-python's are not thread-safe)."""

from __future__ import annotations

import logging
import threading
import time

from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition

from rollstream.kafka.cluster import Bootstrap, as_cluster
from rollstream.kafka.payloads import PayloadFetchTimeout, RefKey
from rollstream.kafka.topics import Topics
from rollstream.runtime import now_ms
from rollstream.trainer.retention import PayloadRetention, ReaderWatch, cut_offsets, is_current, payload_horizon_ms

log = logging.getLogger(__name__)

READ_TIMEOUT_S = 30.0
"""Longest the reader check waits for the records at the readers' positions."""


class PayloadPruner:
    """Delete the payload records of ``topics`` no group can still need, by ``policy``.

    ``deleted``: records deleted so far; ``failures``: prunes or checks that failed (the broker
    away) and did nothing. A failure is logged, never raised: deletion is housekeeping, and the
    next prune catches up.
    """

    def __init__(self, bootstrap: Bootstrap, topics: Topics, policy: PayloadRetention,
                 client_id: str = "rollstream-pruner") -> None:
        self.policy = policy
        self.payload_topics = topics.payload()
        self.readers = [(f"{topics.prefix}{group}", topics.name(topic)) for group, topic in policy.readers]
        self.watch = ReaderWatch(max_gap_ms=policy.max_gap_ms)
        self.deleted = 0
        self.failures = 0
        kwargs = as_cluster(bootstrap).client_kwargs()
        self.consumer = KafkaConsumer(**kwargs, group_id=None, enable_auto_commit=False, client_id=client_id)
        self.admin = KafkaAdminClient(**kwargs, client_id=client_id)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watcher = self._watch_admin = self._thread = None
        if self.readers:  # without them there is nothing to watch
            self._watcher = KafkaConsumer(**kwargs, group_id=None, enable_auto_commit=False,
                                          client_id=f"{client_id}-watch")
            self._watch_admin = KafkaAdminClient(**kwargs, client_id=f"{client_id}-watch")
            self.check()  # known before the trainer's first prune
            self._thread = threading.Thread(target=self._run, name=f"{client_id}-watch", daemon=True)
            self._thread.start()

    # -- the readers ----------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self.policy.every_s):
            self.check()

    def check(self) -> None:
        """Observe whether the readers are current now (a check that fails observes "not")."""
        now = now_ms()
        try:
            current = is_current(self._first_unread_ms(), now)
        except Exception as exc:  # the broker away: not known to be current
            self.failures += 1
            log.warning("payload readers not checked (%s: %s)", type(exc).__name__, exc)
            current = False
        with self._lock:
            self.watch.observe(now, current)

    def _first_unread_ms(self) -> list[int]:
        """The timestamp of each reader partition's oldest unread record (partitions read to the
        end have none): the record at the group's committed offset, or at the log start when the
        group has committed none there (it has read nothing)."""
        positions: dict[TopicPartition, int] = {}
        for group, topic in self.readers:
            tps = [TopicPartition(topic, p) for p in sorted(self._watcher.partitions_for_topic(topic) or ())]
            if not tps:
                continue
            committed = self._watch_admin.list_group_offsets(group).get(group) or {}
            starts, ends = self._watcher.beginning_offsets(tps), self._watcher.end_offsets(tps)
            for tp in tps:
                mark = committed.get(tp)
                position = max(starts[tp], mark.offset if mark is not None and mark.offset >= 0 else starts[tp])
                if position < ends[tp]:
                    positions[tp] = position
        return list(self._timestamps(positions).values())

    def _timestamps(self, positions: dict[TopicPartition, int]) -> dict[TopicPartition, int]:
        """The timestamp of the record at each offset of ``positions``."""
        out: dict[TopicPartition, int] = {}
        if not positions:
            return out
        self._watcher.assign(list(positions))
        try:
            for tp, offset in positions.items():
                self._watcher.seek(tp, offset)
            deadline = time.monotonic() + READ_TIMEOUT_S
            while len(out) < len(positions):
                if time.monotonic() > deadline:
                    raise PayloadFetchTimeout(f"{len(positions) - len(out)} reader positions not read "
                                              f"within {READ_TIMEOUT_S:.0f}s")
                for tp, records in self._watcher.poll(timeout_ms=200, max_records=1000).items():
                    if records and tp not in out:
                        out[tp] = records[0].timestamp
                        self._watcher.pause(tp)
        finally:
            self._watcher.assign([])
        return out

    # -- deletion -------------------------------------------------------------------------------

    def prune(self, seen_ms: int, held: list[RefKey]) -> int:
        """Delete what no group can need as of ``seen_ms``, the trainer having read every
        accepted group by then and holding those whose references are ``held``; returns how
        many records went."""
        with self._lock:
            current_for = self.watch.current_for_ms(seen_ms)
        horizon = payload_horizon_ms(seen_ms, self.policy, current_for)
        if horizon is None or horizon <= 0:
            return 0
        try:
            return self._delete(horizon, held)
        except Exception as exc:
            self.failures += 1
            log.warning("payload records not pruned this time (%s: %s); the next prune tries again",
                        type(exc).__name__, exc)
            return 0

    def _delete(self, horizon_ms: int, held: list[RefKey]) -> int:
        tps = [TopicPartition(t, p) for t in self.payload_topics
               for p in sorted(self.consumer.partitions_for_topic(t) or ())]
        if not tps:
            return 0
        starts, ends = self.consumer.beginning_offsets(tps), self.consumer.end_offsets(tps)
        found = self.consumer.offsets_for_times({tp: horizon_ms for tp in tps})
        time_cuts = {(tp.topic, tp.partition): ends[tp] if found.get(tp) is None else found[tp].offset for tp in tps}
        cuts = {TopicPartition(*key): cut for key, cut in cut_offsets(time_cuts, held).items()}
        cuts = {tp: cut for tp, cut in cuts.items() if cut > starts[tp]}
        if not cuts:
            return 0
        self.admin.delete_records(cuts)
        deleted = sum(cut - starts[tp] for tp, cut in cuts.items())
        self.deleted += deleted
        log.info("pruned %d payload records stamped before %d", deleted, horizon_ms)
        return deleted

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=READ_TIMEOUT_S + 30)
        for client in (self.consumer, self.admin, self._watcher, self._watch_admin):
            if client is not None:
                client.close()
