"""Worker metrics: one prometheus-client registry per process, exposed over HTTP on request and
published as periodic snapshots (``Metric`` events, key = worker id) to the ``metrics`` topic,
which `rollstream stats` and `rollstream report` read back.

Names (all prefixed ``rollstream_``):

- ``rejections_total{unit, reason}``: rejections at every unit: ``prompt`` (admission),
  ``response`` (response filter), ``query`` (query filter / prompt transaction), ``group``
  (agentic group filter and group queue), ``trajectory`` (set aside), ``trainer`` (groups trained,
  or rejected ``stale`` before a step), ``token`` (correction masks: tokens masked);
- ``decided_total{unit, outcome}``: decisions taken (``accepted`` / ``rejected``), for retention;
- ``in_flight{kind}``: prompts or episodes in flight now;
- ``replacement_rounds_total``: replacement generation rounds requested;
- ``reward_sum{scope}`` / ``reward_count{scope}``: ``all`` decided vs ``accepted`` responses;
- ``validation_total{outcome}``: validation groups (original / accepted / rejected);
- ``batch_fill_seconds``: histogram of the time to fill a trainer batch;
- ``events_total{stage}``: events a worker handled.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from rollstream.filtering.prompt_state import Decided, Replacement, ResponseAccepted, ResponseRejected
from rollstream.runtime import now_ms, worker_id
from rollstream.schemas import encode

log = logging.getLogger(__name__)

SNAPSHOT_INTERVAL_S = 10.0


class WorkerMetrics:
    """The metrics of one worker process (see the module doc for the names)."""

    def __init__(self, worker: str) -> None:
        self.worker = worker
        self.registry = CollectorRegistry()
        r = self.registry
        self.rejections = Counter("rollstream_rejections", "Rejections by unit and reason", ["unit", "reason"], registry=r)
        self.decided = Counter("rollstream_decided", "Decisions by unit and outcome", ["unit", "outcome"], registry=r)
        self.in_flight = Gauge("rollstream_in_flight", "Prompts or episodes in flight", ["kind"], registry=r)
        self.replacement_rounds = Counter("rollstream_replacement_rounds", "Replacement rounds requested", registry=r)
        self.reward_sum = Gauge("rollstream_reward_sum", "Sum of response rewards", ["scope"], registry=r)
        self.reward_count = Gauge("rollstream_reward_count", "Responses counted in reward_sum", ["scope"], registry=r)
        self.validation = Counter("rollstream_validation", "Validation groups", ["outcome"], registry=r)
        self.batch_fill = Histogram("rollstream_batch_fill_seconds", "Time to fill a trainer batch", registry=r,
                                    buckets=(1, 5, 10, 30, 60, 120, 300, 600, 1800))
        self.events = Counter("rollstream_events", "Events handled", ["stage"], registry=r)
        self._producer = None
        self._topic = ""
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # -- recording --------------------------------------------------------------------------

    def decision(self, unit: str, accepted: bool, reason: str) -> None:
        self.decided.labels(unit, "accepted" if accepted else "rejected").inc()
        if not accepted:
            self.rejections.labels(unit, reason).inc()

    def rewards(self, scope: str, values: Iterable[float]) -> None:
        values = [v for v in values if v == v]  # NaN rewards are rejected elsewhere, never averaged
        self.reward_sum.labels(scope).inc(sum(values))
        self.reward_count.labels(scope).inc(len(values))

    def prompt_effects(self, effects: Iterable, mode: str) -> None:
        """The aggregator's per-prompt effects (rollstream.filtering.prompt_state)."""
        for effect in effects:
            if isinstance(effect, ResponseAccepted):
                self.decision("response", True, "accepted")
            elif isinstance(effect, ResponseRejected):
                self.decision("response", False, effect.reason)
            elif isinstance(effect, Replacement):
                self.replacement_rounds.inc()
            elif isinstance(effect, Decided):
                if mode == "val":
                    self.validation.labels("original").inc()
                    self.validation.labels("accepted" if effect.accepted else "rejected").inc()
                    continue
                self.decision("query", effect.accepted, effect.reason)
                self.rewards("all", effect.rewards)
                if effect.accepted:
                    self.rewards("accepted", effect.rewards)

    # -- reading ----------------------------------------------------------------------------

    def samples(self) -> list[tuple[str, dict[str, str], float]]:
        """(name, labels, value) of every sample, histograms as their _bucket/_sum/_count."""
        out = []
        for family in self.registry.collect():
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                out.append((sample.name, dict(sample.labels), float(sample.value)))
        return out

    def snapshot(self, now_ms: int) -> list[dict]:
        return [{"worker": self.worker, "name": name, "value": value, "labels": labels, "created_ms": now_ms}
                for name, labels, value in self.samples()]

    # -- exporting --------------------------------------------------------------------------

    def serve(self, port: int) -> None:
        """Expose ``/metrics`` for Prometheus on ``port`` (0 = do not serve)."""
        if port:
            start_http_server(port, registry=self.registry)
            log.info("prometheus metrics on :%d/metrics", port)

    def publish(self) -> int:
        """Send one snapshot to the ``metrics`` topic; returns the samples sent (0 before
        ``start_publishing`` connected)."""
        producer = self._producer
        if producer is None:
            return 0
        records = self.snapshot(now_ms())
        for record in records:
            producer.send(self._topic, key=self.worker.encode(), value=encode(record, "Metric"))
        producer.flush()
        return len(records)

    def start_publishing(self, connect: Callable[[], Any], topic: str,
                         interval_s: float = SNAPSHOT_INTERVAL_S) -> None:
        """Publish a snapshot to ``topic`` every ``interval_s``, and a last one at ``close()``,
        from a daemon thread that also calls ``connect()`` for its producer (a kafka-python
        KafkaProducer), so a slow or absent broker never blocks the caller."""
        self._topic = topic
        self._stop = stop = threading.Event()  # one per publishing period (a process may run twice)

        def loop() -> None:
            try:
                self._producer = connect()
                while not stop.wait(interval_s):
                    self._publish_logged()
                self._publish_logged()
            except Exception:  # metrics must never take a worker down
                log.exception("metrics publishing stopped")
            finally:
                if self._producer is not None:
                    self._producer.close()
                    self._producer = None

        self._thread = threading.Thread(target=loop, name="metrics", daemon=True)
        self._thread.start()

    def _publish_logged(self) -> None:
        try:
            self.publish()
        except Exception:
            log.exception("metrics snapshot failed")

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop publishing after a last snapshot (waits up to ``timeout_s`` for it)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)


_PROCESS: WorkerMetrics | None = None


def process_metrics(worker: str | None = None) -> WorkerMetrics:
    """This process's WorkerMetrics (created on first use; ``worker`` names it then)."""
    global _PROCESS
    if _PROCESS is None:
        _PROCESS = WorkerMetrics(worker or worker_id("worker"))
    return _PROCESS
