"""The trainer's Kafka shell: accepted groups in, one ``RolloutBatch`` per step out.

``BatchBuilder`` consumes ``groups.accepted`` (kafka-python, auto-commit off), where RLVR ``Group``
and agentic ``TrajectoryGroup`` records may be mixed, and hands out batches of exactly
``rollout_batch_size`` complete groups (either kind, in consumption order; see
``rollstream.trainer.batch`` for how each becomes rows); the caller trains on a batch and then
confirms it with ``commit(batch)``. Only then are the manifest line appended, the ``Batch`` event
published and the offsets committed, in that order, so a restarted trainer neither trains a group
twice nor skips one (docs/semantics.md, "Guarantees").

One trainer per group id: it owns every partition of ``groups.accepted`` (manual assignment; the
group id only stores committed offsets). A thread of its own polls the consumer
(``rollstream.kafka.polling.ConsumerPoller``), so groups are read, and their arrival stamped,
while the caller trains a step; the builder takes them in at its next call. Data-parallel
training ranks share it through ``rollstream.trainer.rollout_stream.RolloutStream``: rank 0 holds
the one builder and scatters each batch.

Each concern has its home: offsets in ``rollstream.kafka.offsets.OffsetTracker``, the fsynced
manifest in ``rollstream.trainer.manifest``, the ``Batch`` record in
``rollstream.schemas.records.batch_event``, rows from groups in ``rollstream.trainer.batch``,
what may enter the buffer in ``rollstream.trainer.intake``; this module wires them to the
consumer and producer.

Offset rule: per partition, the committed offset is the lowest offset whose record is not yet done
(buffered for a later batch, or in a batch handed out but not committed), or the next offset to
read when every consumed record is done. Done means: in a committed batch, a recognised duplicate,
or dead-lettered. Groups consumed beyond a batch stay buffered for the next one.

Edge cases:

- A group whose ``group_key`` was already seen (redelivery) is skipped and counted in
  ``duplicates``. The keys of every manifest line are loaded at start, so groups trained before a
  crash between manifest write and offset commit are recognised too.
- An event that does not decode, is neither a ``Group`` nor a ``TrajectoryGroup``, is not accepted,
  or fails ``check_group`` goes to ``dead-letter`` with its reason (``undecodable``,
  ``unknown_schema``, ``invalid_event``).
- Payloads: a group's members name their token arrays by ``PayloadRef``. They are
  fetched only when a batch is built, after the stale check, only for the groups going into it:
  one ``PayloadFetcher.fetch`` for all their references, each value decoded and put in place of
  its reference in a copy of the group (``rollstream.trainer.intake.resolve_payloads``). A group
  with a reference below its partition's log start offset (retention deleted the payload) is
  never trained: it goes to ``groups.rejected`` with reason ``payload_expired`` (values:
  ``payload_expired`` = expired references, ``members``), counts in ``payload_expired_groups``,
  and its offset is done. A payload that does not decode, is another schema or another member's,
  or fails ``check_payloads`` dead-letters its group (``invalid_event``). Either way the builder
  goes on filling the batch from the next groups. Members whose payload is inline (events of the
  old format, upgraded at decode) need no fetch.
- ``take_partial()`` ships what is buffered when admission reported ``batch_underfilled`` and
  ``min_fill_ratio`` allows it; the manifest status is then ``partial``.

Payload retention follows consumption (``payload_retention``): at most every ``every_s``, after a
commit, when its consumer has read ``groups.accepted`` to the end, the builder has the payloads no
group can still need deleted (rollstream.trainer.retention), never one a group it holds names
(rollstream.trainer.payload_pruner).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from rollstream.filtering.decision import Decision
from rollstream.filtering.reasons import RejectReason
from rollstream.filtering.staleness import stale_decision
from rollstream.kafka.clients import assigned_consumer, commit_offsets, make_producer
from rollstream.kafka.cluster import Bootstrap
from rollstream.kafka.events import dead_letter
from rollstream.kafka.offsets import OffsetTracker
from rollstream.kafka.payloads import Fetched, PayloadFetcher, ref_key
from rollstream.kafka.polling import ConsumerPoller
from rollstream.kafka.topics import Topics
from rollstream.observability.metrics import process_metrics
from rollstream.runtime import PAYLOAD_MAX_MESSAGE_BYTES, now_ms, worker_id
from rollstream.schemas import encode
from rollstream.schemas.records import batch_event, group_rows, group_schema, payload_refs
from rollstream.trainer.batch import RolloutBatch, build_batch, check_payloads, extras_shapes, resolve_estimator
from rollstream.trainer.intake import (
    DEDUP_WINDOW,
    RecentKeys,
    resolve_payloads,
    stale_rejection,
    trainable_group,
)
from rollstream.trainer.manifest import Manifest, ManifestState
from rollstream.trainer.payload_pruner import PayloadPruner
from rollstream.trainer.retention import PayloadRetention

log = logging.getLogger(__name__)

POLL_TIMEOUT_S = 0.2
"""Longest single wait for groups inside ``next_batch``; the loop re-checks its deadline after each."""


@dataclass(eq=False)
class _Pending:
    """A consumed, valid group not yet in a committed batch. ``group``: the event as consumed
    (payload references); ``resolved``: the copy with its payloads decoded, once fetched;
    ``source``: the consumed record (for a dead letter); ``arrived_ms``: when the builder's
    consumer read it (epoch ms)."""

    group: dict
    partition: int
    offset: int
    source: object = None
    resolved: dict | None = None
    arrived_ms: int = 0


@dataclass(frozen=True)
class _Outstanding:
    """A batch handed out by ``next_batch``/``take_partial``, awaiting ``commit``."""

    items: list[_Pending]
    status: str
    fill_seconds: float


class BatchBuilder:
    """Collect accepted groups from Kafka into training batches; commit when the caller confirms.

    Args:
        bootstrap: Kafka bootstrap servers.
        topics: topic names; reads ``topics.groups_accepted``, writes ``topics.batches``,
            ``topics.groups_rejected`` and ``topics.dead_letter``.
        rollout_batch_size: groups per batch (B = groups x responses / trajectories per group).
        group_id: Kafka consumer group; a new builder with the same id resumes after the last
            committed batch.
        manifest_path: JSON-lines file; one line per committed batch. Read at start to restore
            the step counter and the seen group keys (see ``rollstream.trainer.manifest``).
        pad_token_id: padding token for ``build_batch``.
        max_staleness: policy versions a group may lag the version that trains it (= the step:
            version v is the policy after v batches). A buffered group beyond the bound is
            never trained: it goes to ``groups.rejected`` with reason ``stale`` and its values,
            and counts in ``stale_groups``. None: unbounded.
        max_message_bytes: the largest payload event (``kafka.max_message_bytes``), the fetch
            size of the ``PayloadFetcher``.
        adv_estimator: the advantage estimator of the batches (``ADV_ESTIMATORS``, see
            ``rollstream.trainer.batch.group_advantages``).
        payload_retention: how this builder deletes the payloads no group can still need
            (module doc); None: it deletes none.

    Raises:
        ValueError: ``rollout_batch_size`` < 1, or an unknown ``adv_estimator``.
    """

    max_poll_records = 500  # records fetched per poll
    dedup_window = DEDUP_WINDOW  # group keys remembered for duplicate detection
    # how long one batch's payload fetch may take before ``PayloadFetchTimeout`` (a broker that
    # stopped answering) is raised out of ``next_batch`` / ``take_partial``; nothing is committed then
    payload_fetch_timeout_s = 60.0

    def __init__(
        self,
        bootstrap: Bootstrap,
        topics: Topics,
        rollout_batch_size: int,
        group_id: str = "rollstream-trainer",
        manifest_path: Path | None = None,
        pad_token_id: int = 0,
        *,
        max_staleness: int | None = None,
        max_message_bytes: int = PAYLOAD_MAX_MESSAGE_BYTES,
        adv_estimator: str = "grpo",
        payload_retention: PayloadRetention | None = None,
    ) -> None:
        if rollout_batch_size < 1:
            raise ValueError(f"rollout_batch_size must be >= 1, got {rollout_batch_size}")
        resolve_estimator(adv_estimator)  # raises ValueError for an unknown one
        self.adv_estimator = adv_estimator
        self.topics = topics
        self.topic = topics.groups_accepted
        self.rollout_batch_size = rollout_batch_size
        self.pad_token_id = pad_token_id
        self.manifest_path = Path(manifest_path) if manifest_path is not None else None
        self.max_staleness = max_staleness
        self.worker = worker_id("trainer")

        self.consumed = 0  # records read, whatever became of them
        self.duplicates = 0  # redelivered groups skipped
        self.dead_lettered = 0  # records sent to dead-letter
        self.stale_groups = 0  # groups rejected as stale instead of trained
        self.payload_expired_groups = 0  # groups rejected payload_expired instead of trained
        self.invalid_payload_groups = 0  # groups dead-lettered for a payload that cannot be trained
        self.payload_fetch_seconds = 0.0  # wall time spent in PayloadFetcher.fetch

        self._seen = RecentKeys(self.dedup_window)
        self._buffer: list[_Pending] = []  # valid groups not yet in a batch, in consumption order
        self._outstanding: dict[int, _Outstanding] = {}  # step -> batch awaiting commit
        self._offsets = OffsetTracker()  # pending: groups buffered or in an outstanding batch
        self._fill_started: float | None = None  # monotonic time of this step's first poll

        self._manifest = Manifest(self.manifest_path) if self.manifest_path is not None else None
        restored = self._manifest.load() if self._manifest is not None else ManifestState()
        for key in restored.group_keys:
            self._seen.add(key)
        self.committed_groups = restored.committed_groups  # groups in committed batches, the manifest's included
        last_entry = restored.last
        self.last_entry: dict | None = last_entry  # the manifest entry of the newest committed step
        self.step = 0 if last_entry is None else last_entry["step"] + 1  # the next step to build

        # One trainer owns every partition: manual assignment, no group membership; the group id
        # only stores committed offsets. (kafka-python 3.0 could drop a member out of its group
        # for good after a missed heartbeat, spinning in poll.)
        consumer, _ = assigned_consumer(bootstrap, group_id, self.topic, self.worker, self.max_poll_records)
        self._poller = ConsumerPoller(consumer, f"{self.worker}-poller", self.max_poll_records)
        self.producer = make_producer(bootstrap, client_id=self.worker)
        self.fetcher = PayloadFetcher(bootstrap, max_message_bytes, client_id=f"{self.worker}-payloads")
        self._pruner = PayloadPruner(bootstrap, topics, payload_retention, client_id=f"{self.worker}-pruner") \
            if payload_retention is not None and payload_retention.keep_ms >= 0 else None
        self._next_prune = 0.0  # monotonic time of the next payload pruning
        if last_entry is not None:  # a crash may have come between its manifest line and its event
            self._publish_batch(last_entry)
            self.producer.flush()

    # -- public API -------------------------------------------------------------------------

    @property
    def buffered(self) -> int:
        """Complete groups consumed and waiting for a batch."""
        return len(self._buffer)

    def next_batch(self, timeout_s: float) -> RolloutBatch | None:
        """Poll until ``rollout_batch_size`` complete groups are buffered; build and return a batch.

        The payloads of the groups going into the batch are fetched then; a group whose payload
        expired or cannot be trained leaves the buffer (see the module doc) and the builder polls
        on for another. Returns None when ``timeout_s`` passes first; the buffered groups and the
        step's fill clock are kept for the next call. The batch is outstanding until
        ``commit(batch)``. Raises PayloadFetchTimeout when the payload fetch stalls.
        """
        if self._fill_started is None:
            self._fill_started = time.monotonic()
        deadline = time.monotonic() + timeout_s
        self._take_arrived(0.0)
        self._reject_stale()
        while True:
            while len(self._buffer) < self.rollout_batch_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._take_arrived(min(remaining, POLL_TIMEOUT_S))
                self._reject_stale()
            if self._resolve_head(self.rollout_batch_size):
                return self._build(self.rollout_batch_size, "complete")

    def take_partial(self, timeout_s: float = 0.0, min_groups: int | None = None) -> RolloutBatch | None:
        """Build a batch from the complete groups buffered now (at most ``rollout_batch_size``).

        For the case where admission published ``batch_underfilled`` and ``min_fill_ratio`` allows
        a partial batch; the caller checks the ratio. Polls for up to ``timeout_s`` first (stopping
        early when full, or once ``min_groups`` groups are buffered). Returns None when nothing is
        buffered (groups the consumer has read count as buffered). The manifest status is
        ``partial``, or ``complete`` if the buffer happened to be full. Payloads are fetched as in
        ``next_batch``; groups whose payload expired or cannot be trained are replaced by the next
        buffered ones (None when none is left).
        """
        if self._fill_started is None:
            self._fill_started = time.monotonic()
        deadline = time.monotonic() + timeout_s
        enough = min(self.rollout_batch_size, min_groups or self.rollout_batch_size)
        self._take_arrived(0.0)
        self._reject_stale()
        while len(self._buffer) < enough and time.monotonic() < deadline:
            self._take_arrived(min(deadline - time.monotonic(), POLL_TIMEOUT_S))
            self._reject_stale()
        while self._buffer:
            n = min(len(self._buffer), self.rollout_batch_size)
            if self._resolve_head(n):
                return self._build(n, "complete" if n == self.rollout_batch_size else "partial")
        return None

    def commit(self, batch: RolloutBatch, report: dict | None = None) -> dict:
        """Confirm ``batch`` was trained: append its manifest line, publish ``Batch``, commit.

        Order: manifest line (fsynced) -> ``Batch`` event and pending dead letters acknowledged ->
        offsets committed. A crash in between re-delivers the groups, which the manifest's keys
        then mark as duplicates.

        Returns the manifest entry: ``step``, ``status``, ``target_groups``, ``accepted_groups``,
        ``group_keys``, ``offsets`` (partition as str -> next offset committed), ``fill_seconds``,
        ``responses_per_group`` (responses or trajectories per group), ``arrived_ms`` (when
        the consumer read each group, epoch ms), ``arrival_lag_ms`` (each group's arrival minus
        its event's ``created_ms``, when the aggregator or the group queue decided it: the lag of
        the decision plane, ms; None for an event without ``created_ms``), ``created_ms``, plus
        the keys of ``report`` (the training step's figures, see PolicyTrainer.train).

        Raises:
            ValueError: ``batch`` is not an outstanding batch of this builder (e.g. committed).
            kafka.errors.CommitFailedError: the broker refused the offsets (after the manifest
                line and the event, so a restart recognises the groups as duplicates).
        """
        out = self._outstanding.pop(batch.step, None)
        if out is None:
            raise ValueError(
                f"step {batch.step} is not an outstanding batch of this builder "
                f"(outstanding: {sorted(self._outstanding)}); was it committed already?"
            )
        for item in out.items:
            self._offsets.done(item.partition, item.offset)
        self.committed_groups += len(out.items)
        with self._poller.paused() as consumer:  # no poll now: its positions are past what it read
            self._ingest_all(self._poller.drain())
            entry = self._commit(consumer, batch, out, report)
            snapshot = self._held_refs(consumer)
        if snapshot is not None:
            self._pruner.prune(*snapshot)
        return entry

    def _commit(self, consumer, batch: RolloutBatch, out: _Outstanding, report: dict | None) -> dict:
        assigned = [tp for tp in consumer.assignment() if tp.topic == self.topic]
        committable = self._offsets.committable()
        # partitions not read from since assignment sit at their committed (or reset) offset
        offsets = {tp.partition: committable[tp.partition] if tp.partition in committable
                   else consumer.position(tp) for tp in assigned}
        entry = {
            "step": batch.step,
            "status": out.status,
            "target_groups": self.rollout_batch_size,
            "accepted_groups": len(out.items),
            "group_keys": [item.group["group_key"] for item in out.items],
            "offsets": {str(p): o for p, o in sorted(offsets.items())},
            "fill_seconds": out.fill_seconds,
            "responses_per_group": [len(group_rows(item.group)) for item in out.items],
            "arrived_ms": [item.arrived_ms for item in out.items],
            "arrival_lag_ms": [item.arrived_ms - item.group["created_ms"] if item.group.get("created_ms") else None
                               for item in out.items],  # None: an event without its decision time
            "created_ms": now_ms(),
            **(report or {}),  # the training step's figures (loss, policy_version, masks ...)
        }
        self._record(entry)  # flushes the Batch event and every dead letter before their offsets
        # only read partitions are committed; the others keep their committed offset
        to_commit = {p: o for p, o in self._offsets.to_commit().items() if p in offsets}
        commit_offsets(consumer, self.topic, to_commit)
        self._offsets.committed(to_commit)
        return entry

    def _held_refs(self, consumer) -> tuple[int, list] | None:
        """When pruning is due and the consumer has read every partition to the end the broker
        reports now (so it holds every accepted group not yet trained): that time (epoch ms) and
        the references of those groups; else None. A failure to ask is a None: pruning waits."""
        if self._pruner is None or time.monotonic() < self._next_prune:
            return None
        self._next_prune = time.monotonic() + self._pruner.policy.every_s
        assigned = [tp for tp in consumer.assignment() if tp.topic == self.topic]
        seen = now_ms()
        try:
            ends = consumer.end_offsets(assigned)
        except Exception as exc:  # the broker away: prune another time
            log.warning("payload pruning skipped: %s: %s", type(exc).__name__, exc)
            return None
        if any(consumer.position(tp) is None or consumer.position(tp) < ends[tp] for tp in assigned):
            return None
        items = [*self._buffer, *(item for out in self._outstanding.values() for item in out.items)]
        return seen, [ref_key(ref) for item in items for ref in payload_refs(item.group)]

    def recover(self, trained: dict) -> dict | None:
        """Record a batch that was trained (its checkpoint is durable) but never committed: the
        trainer died between the checkpoint and the manifest line.

        ``trained`` is the checkpoint's trainer state (``step``, ``group_keys``, ``report``).
        Its group keys count as seen, so their redelivered records are skipped as duplicates
        (never trained twice); the manifest gets the line (status ``recovered``) and the step
        counter moves past it. Call before the first poll. Returns the manifest entry, or None
        when the manifest already has that step.
        """
        step = int(trained["step"])
        if self.last_entry is not None and step <= self.last_entry["step"]:
            return None
        keys = list(trained["group_keys"])
        for key in keys:
            self._seen.add(key)
        entry = {
            "step": step, "status": "recovered", "target_groups": self.rollout_batch_size,
            "accepted_groups": len(keys), "group_keys": keys, "offsets": {}, "fill_seconds": 0.0,
            "responses_per_group": [], "created_ms": now_ms(), **trained.get("report", {}),
        }
        self._record(entry)
        self.committed_groups += len(keys)
        self.step = max(self.step, step + 1)
        log.warning("recovered step %d from its checkpoint: %d groups trained but not committed", step, len(keys))
        return entry

    @property
    def dropped_groups(self) -> int:
        """Groups that passed intake but will never be trained: rejected ``stale`` or
        ``payload_expired``, or dead-lettered for their payload."""
        return self.stale_groups + self.payload_expired_groups + self.invalid_payload_groups

    def metrics(self) -> dict[str, float]:
        """Counters under ``trainer/batch/``: groups consumed, duplicates, dead-lettered, buffered,
        outstanding, stale, payload_expired; the payload fetcher's records fetched, bytes fetched,
        seconds spent fetching and records read on the way that no reference named (skipped)."""
        return {
            "trainer/batch/consumed": self.consumed,
            "trainer/batch/duplicates": self.duplicates,
            "trainer/batch/dead_lettered": self.dead_lettered,
            "trainer/batch/buffered": len(self._buffer),
            "trainer/batch/outstanding": len(self._outstanding),
            "trainer/batch/stale_groups": self.stale_groups,
            "trainer/batch/payload_expired_groups": self.payload_expired_groups,
            "trainer/batch/payload_records_fetched": self.fetcher.fetched,
            "trainer/batch/payload_bytes_fetched": self.fetcher.fetched_bytes,
            "trainer/batch/payload_fetch_seconds": self.payload_fetch_seconds,
            "trainer/batch/payload_records_skipped": self.fetcher.skipped,
            "trainer/batch/payload_records_pruned": self._pruner.deleted if self._pruner is not None else 0,
        }

    def close(self) -> None:
        """Flush pending dead letters and close the clients; uncommitted batches are redelivered."""
        try:
            self.producer.flush()
            self.producer.close()
        finally:
            try:
                self.fetcher.close()
                if self._pruner is not None:
                    self._pruner.close()
            finally:
                self._poller.close()
                self._poller.consumer.close(autocommit=False)

    def __enter__(self) -> "BatchBuilder":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------

    def _take_arrived(self, timeout_s: float) -> None:
        """Take in the groups the poller has read, waiting up to ``timeout_s`` for the first."""
        self._ingest_all(self._poller.take(timeout_s))

    def _ingest_all(self, arrived: list[tuple[object, int]]) -> None:
        for msg, arrived_ms in arrived:
            self._ingest(msg, arrived_ms)

    def _ingest(self, msg, arrived_ms: int) -> None:
        self.consumed += 1
        group, problem = trainable_group(msg.value)
        if problem is not None:  # done once its dead letter is flushed, before the next commit
            self._offsets.read(msg.partition, msg.offset, pending=False)
            self._dead_letter(msg, *problem)
            return
        key = group["group_key"]
        if key in self._seen:
            self._offsets.read(msg.partition, msg.offset, pending=False)
            self.duplicates += 1
            log.info("skipping duplicate group %r at %s[%d]@%d", key, msg.topic, msg.partition,
                     msg.offset)
            return
        self._seen.add(key)
        self._offsets.read(msg.partition, msg.offset)
        self._buffer.append(_Pending(group, msg.partition, msg.offset, msg, arrived_ms=arrived_ms))

    def _reject_stale(self) -> None:
        """Move buffered groups the next step may not train (see ``max_staleness``) to
        ``groups.rejected``; their offsets count as done."""
        if self.max_staleness is None:
            return
        keep = []
        for item in self._buffer:
            decision = stale_decision(int(item.group.get("policy_version", 0)), self.step, self.max_staleness)
            if decision is None:
                keep.append(item)
                continue
            self._reject(item, decision)
            self.stale_groups += 1
            log.info("group %r rejected as stale before step %d: %s", item.group["group_key"], self.step,
                     dict(decision.values))
        self._buffer = keep

    def _reject(self, item: _Pending, decision: Decision) -> None:
        """Send ``item``'s group to ``groups.rejected`` with ``decision`` (the event as consumed,
        payload references and all); its offset is done once the send is flushed."""
        group = stale_rejection(item.group, decision)
        self.producer.send(self.topics.groups_rejected, key=group["group_key"].encode(),
                           value=encode(group, group_schema(group)))
        self._offsets.done(item.partition, item.offset)
        process_metrics().decision("trainer", False, decision.reason)

    def _resolve_head(self, n: int) -> bool:
        """Fetch and decode the payloads of the first ``n`` buffered groups (those not resolved
        yet), with one fetch. Groups that cannot be trained leave the buffer (payload_expired
        rejection or dead letter). True when the first ``n`` groups are all resolved."""
        head = self._buffer[:n]
        todo = [item for item in head if item.resolved is None]
        if not todo:
            return True
        refs = [ref for item in todo for ref in payload_refs(item.group)]
        fetched = Fetched()
        if refs:
            started = time.monotonic()
            try:
                fetched = self.fetcher.fetch(refs, timeout_s=self.payload_fetch_timeout_s)
            finally:
                self.payload_fetch_seconds += time.monotonic() - started
        dropped: set[int] = set()
        for item in todo:
            expired = [fetched.expired[k] for k in map(ref_key, payload_refs(item.group)) if k in fetched.expired]
            if expired:
                members = len(group_rows(item.group))
                self._reject(item, Decision.reject(RejectReason.PAYLOAD_EXPIRED, payload_expired=float(len(expired)),
                                                   members=float(members)))
                self.payload_expired_groups += 1
                log.warning("group %r rejected payload_expired before step %d: %d of %d payloads gone (%s)",
                            item.group["group_key"], self.step, len(expired), members, expired[0])
                dropped.add(id(item))
                continue
            try:
                resolved = resolve_payloads(item.group, fetched.values)
                check_payloads(resolved)
            except ValueError as exc:
                self._dead_letter(item.source, "invalid_event", f"payload: {exc}")
                self._offsets.done(item.partition, item.offset)
                self.invalid_payload_groups += 1
                dropped.add(id(item))
                continue
            item.resolved = resolved
        reference: dict[str, tuple] = {}  # one shape per extras name in a batch (one tensor each)
        for item in head:
            if id(item) in dropped or item.resolved is None:
                continue
            shapes = extras_shapes(item.resolved)
            clash = {n: (reference[n], s) for n, s in shapes.items() if n in reference and reference[n] != s}
            if clash:
                self._dead_letter(item.source, "invalid_event", f"payload: extras shapes {clash} differ from the "
                                                                "batch's earlier groups")
                self._offsets.done(item.partition, item.offset)
                self.invalid_payload_groups += 1
                dropped.add(id(item))
                continue
            reference.update(shapes)
        if dropped:
            self._buffer = [item for item in self._buffer if id(item) not in dropped]
        return not dropped

    def _dead_letter(self, msg, reason: str, error: str) -> None:
        log.warning("dead-lettering %s[%d]@%d: %s: %s", msg.topic, msg.partition, msg.offset, reason, error)
        out = dead_letter(self.topics, msg, reason, error, self.worker)
        self.producer.send(out.topic, key=out.key.encode(), value=encode(out.record, out.schema))
        self.dead_lettered += 1

    def _build(self, n: int, status: str) -> RolloutBatch:
        items, self._buffer = self._buffer[:n], self._buffer[n:]
        started = self._fill_started
        fill_seconds = 0.0 if started is None else time.monotonic() - started
        self._fill_started = None
        batch = build_batch([item.resolved for item in items], self.step, self.pad_token_id, self.adv_estimator)
        for item in items:  # the tokens are in the batch now; the entry keeps the small event
            item.resolved = None
        self._outstanding[batch.step] = _Outstanding(items, status, fill_seconds)
        self.step += 1
        return batch

    def _record(self, entry: dict) -> None:
        """Append ``entry`` to the manifest (fsynced), publish its ``Batch`` event and flush the
        producer (the event and every pending send acknowledged)."""
        if self._manifest is not None:
            self._manifest.append(entry)
        self.last_entry = entry
        self._publish_batch(entry)
        self.producer.flush()

    def _publish_batch(self, entry: dict) -> None:
        """Send the ``Batch`` event of a manifest entry (key = step; at least once: a restart
        re-sends the last one, so readers keep one event per step)."""
        keys = entry.get("group_keys", [])
        event = batch_event(
            step=entry["step"], status=entry.get("status", "complete"),
            target=entry.get("target_groups", self.rollout_batch_size),
            accepted=entry.get("accepted_groups", len(keys)), group_keys=keys,
            offsets=entry.get("offsets", {}), fill_seconds=entry.get("fill_seconds", 0.0),
            created_ms=entry.get("created_ms", 0),
        )
        self.producer.send(self.topics.batches, key=str(entry["step"]).encode(), value=encode(event, "Batch"))
