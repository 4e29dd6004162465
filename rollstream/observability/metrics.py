"""Worker metrics, for display only: nothing in rollstream reads a metric to decide anything
(decisions other stages act on are events with their own schemas).

Each process keeps one prometheus-client registry, exposed over HTTP on request and published as
periodic snapshots (``Metric`` events, key = worker id) to the ``metrics`` topic, which
`rollstream stats` and `rollstream report` read back. Some stages also publish per-event
``Metric`` records there (the group queue's decisions, the trainer's step figures). Every name
is in ``METRICS`` below, with its labels and meaning, the names the experiment trackers log
(rollstream.observability.trackers) included.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, start_http_server

from rollstream.runtime import now_ms, worker_id
from rollstream.schemas import encode

log = logging.getLogger(__name__)

SNAPSHOT_INTERVAL_S = 10.0
VERSION_SERIES_KEPT = 64
"""Policy versions whose series (label ``policy_version`` or ``version``) a worker keeps. A series
more than this many versions behind the newest is frozen (a later update to it is not counted:
the run's summary reads the topics, not these), published once more and dropped from the
registry, so a run of any length holds a bounded number of series; ``stats`` keeps showing the
dropped ones' last values from the ``metrics`` topic."""

STEP_SCALARS = ("fill_seconds", "accepted_groups", "loss", "reward_mean", "final_mask_mean", "grad_norm",
                "pg_clipfrac", "policy_version", "policy_lag_max", "train_seconds")


METRICS: dict[str, str] = {
    # prometheus-client registry of every worker (snapshots every 10 s)
    "rollstream_rejections_total": "{unit, reason} rejections per unit: prompt (admission), response "
                                   "(response filter), query (query filter), group (agentic group queue), "
                                   "trajectory (set aside), trainer (stale or payload_expired before a step), "
                                   "token (correction masks)",
    "rollstream_decided_total": "{unit, outcome} decisions taken, accepted or rejected (retention)",
    "rollstream_in_flight": "{kind} prompts or episodes in flight now",
    "rollstream_replacement_rounds_total": "replacement generation rounds requested",
    "rollstream_reward_sum": "{scope} sum of response rewards, all decided vs accepted",
    "rollstream_reward_count": "{scope} responses counted in rollstream_reward_sum",
    "rollstream_validation_total": "{outcome} validation groups: original / accepted / rejected",
    "rollstream_version_reward_sum": "{mode, policy_version} sum of the kept responses' rewards of the groups "
                                     "decided at a policy version: train (the on-policy reward) and val (each "
                                     "eval_steps round); one label value per version, the newest "
                                     "VERSION_SERIES_KEPT (64) kept",
    "rollstream_version_reward_count": "{mode, policy_version} responses counted in rollstream_version_reward_sum",
    "rollstream_version_correct_count": "{mode, policy_version} of them with a reward > 0",
    "rollstream_batch_fill_seconds": "histogram of the time to fill a trainer batch",
    "rollstream_events_total": "{stage} events a worker handled",
    "rollstream_first_token_ms": "epoch ms at which this generation worker's engine drew its first token (after "
                                 "the first prefill; engines that sample in the worker: transformers)",
    "rollstream_weight_update_ms": "{server, version, mode} an inference server's in-place load of a policy "
                                   "version, pause to resume (the vllm_server backend)",
    # prometheus-client's process collector (Linux), what a long run's alerts watch
    "process_resident_memory_bytes": "the worker process's resident memory",
    "process_virtual_memory_bytes": "the worker process's virtual memory",
    "process_open_fds": "the worker process's open file descriptors",
    "process_max_fds": "the worker process's file descriptor limit",
    "process_cpu_seconds_total": "CPU seconds the worker process used",
    "process_start_time_seconds": "when the worker process started (epoch s): a restart resets it",
    # per-event records of the agentic group queue (labels mode, group_id)
    "group_queue/groups": "{reason} one per decided episode",
    "scheduler/group_filter_count": "{reason} one per group the group filter (or staleness) dropped",
    "group_queue/episodes_replaced": "one per replacement episode started",
    "group_queue/set_aside": "{reason} one per trajectory set aside (infra_abort, invalid_reward, invalid_trajectory)",
    "group_queue/late_trajectories": "one per run that arrived after its episode closed",
    "group_queue/redundancy_saved_ms": "ms between a group's decision and its slowest run's arrival",
    "group_queue/done": "{status} a group id stopped; value = accepted episodes (display only: the trainer "
                        "reads the group queue's outcome events)",
    # the trainer's figures per committed batch (label step)
    **{f"trainer/{k}": "a committed batch's figure from its manifest entry" for k in STEP_SCALARS},
    "trainer/mask_collapse": "1 when the final correction mask removed every token",
    "trainer/pass_rate": "{check} share of valid tokens a correction filter kept",
    "trainer/ratio_mean": "{agg} mean train/infer probability ratio per aggregation level",
    "trainer/diff_mean": "{agg} mean train/infer probability difference per aggregation level",
    # the run summary's figures (rollstream.tools.summary) so far, for the experiment trackers only
    # (rollstream.observability.trackers; no Metric record): after every committed step, and the
    # summary's own at the end of `rollstream run`
    "run/groups_accepted": "groups the filters accepted",
    "run/groups_rejected": "{reason} groups the filters rejected, by reason",
    "run/retention_rate": "accepted / decided groups (prompts skipped by the history filter not counted)",
    "run/responses_per_accepted_response": "train responses (agentic: trajectories) generated per accepted one",
    "run/zero_variance_share": "generated train groups whose responses all got the same reward (screened-out ones included)",
    "run/share_of_tokens_trained_on": "response tokens of accepted groups / all generated train response tokens",
    "validation/accuracy": "{policy_version} a validation round's accuracy: share of correct responses",
    "validation/reward_mean": "{policy_version} a validation round's mean reward",
    "validation/pass_at_k": "{k, policy_version} a validation round's unbiased pass@k (k = 1 and n)",
    "global_step": "the trackers' x axis: steps committed (a step's figures are logged at its step + 1, the "
                   "policy version it made; validation of version v at v); a column of its own in wandb",
}
"""Every metric name rollstream publishes -> "{labels} meaning"."""

HISTOGRAM_SAMPLES = ("_bucket", "_sum", "_count")  # the samples prometheus-client makes of a histogram


def check_name(name: str) -> str:
    """``name`` when METRICS has it (a histogram's ``_bucket``/``_sum``/``_count`` samples
    included); raises KeyError otherwise, so no undocumented metric is ever published or logged."""
    if name not in METRICS and not any(name == f"{base}{part}" for base in METRICS
                                       for part in HISTOGRAM_SAMPLES):
        raise KeyError(f"metric {name!r} is not in rollstream.observability.metrics.METRICS")
    return name


def metric_record(worker: str, name: str, value: float, labels: dict[str, str], created_ms: int) -> dict:
    """A ``Metric`` event (schemas/metric.avsc). Raises KeyError for a name missing from METRICS."""
    check_name(name)
    return {"worker": worker, "name": name, "value": float(value), "labels": labels, "created_ms": created_ms}


def step_metrics(entry: dict, worker: str) -> list[dict]:
    """Metric records of one committed batch: ``trainer/<figure>`` for the scalars present,
    ``trainer/mask_collapse`` (0/1), ``trainer/pass_rate`` (label ``check``: the filter's metric
    key), ``trainer/ratio_mean`` and ``trainer/diff_mean`` (label ``agg``); all labelled
    ``step``."""
    created, step = now_ms(), str(entry["step"])

    def metric(name: str, value: float, **labels: str) -> dict:
        return metric_record(worker, name, value, {"step": step, **labels}, created)

    out = [metric(f"trainer/{k}", entry[k]) for k in STEP_SCALARS if isinstance(entry.get(k), (int, float))]
    if "mask_collapse" in entry:
        out.append(metric("trainer/mask_collapse", float(entry["mask_collapse"])))
    out += [metric("trainer/pass_rate", v, check=k) for k, v in entry.get("pass_rates", {}).items()]
    for name in ("ratio_mean", "diff_mean"):
        out += [metric(f"trainer/{name}", v, agg=agg) for agg, v in entry.get(f"{name}s", {}).items()]
    return out


class WorkerMetrics:
    """The metrics of one worker process (see the module doc for the names)."""

    def __init__(self, worker: str) -> None:
        self.worker = worker
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # memory, descriptors, CPU: what a long run's alerts watch
        self.rejections = Counter("rollstream_rejections", "Rejections by unit and reason", ["unit", "reason"], registry=r)
        self.decided = Counter("rollstream_decided", "Decisions by unit and outcome", ["unit", "outcome"], registry=r)
        self.in_flight = Gauge("rollstream_in_flight", "Prompts or episodes in flight", ["kind"], registry=r)
        self.replacement_rounds = Counter("rollstream_replacement_rounds", "Replacement rounds requested", registry=r)
        self.reward_sum = Gauge("rollstream_reward_sum", "Sum of response rewards", ["scope"], registry=r)
        self.reward_count = Gauge("rollstream_reward_count", "Responses counted in reward_sum", ["scope"], registry=r)
        self.validation = Counter("rollstream_validation", "Validation groups", ["outcome"], registry=r)
        labels = ["mode", "policy_version"]
        self.version_reward_sum = Gauge("rollstream_version_reward_sum", "Reward sum by version", labels, registry=r)
        self.version_reward_count = Gauge("rollstream_version_reward_count", "Rewards by version", labels, registry=r)
        self.version_correct = Gauge("rollstream_version_correct_count", "Rewards > 0 by version", labels, registry=r)
        self.batch_fill = Histogram("rollstream_batch_fill_seconds", "Time to fill a trainer batch", registry=r,
                                    buckets=(1, 5, 10, 30, 60, 120, 300, 600, 1800))
        self.events = Counter("rollstream_events", "Events handled", ["stage"], registry=r)
        self.first_token_ms = Gauge("rollstream_first_token_ms", "Epoch ms of the first generated token",
                                    registry=r)
        self.weight_update_ms = Gauge("rollstream_weight_update_ms", "In-place weight load of an inference server, "
                                      "pause to resume", ["server", "version", "mode"], registry=r)
        self._newest_version = -1
        self._series_lock = threading.Lock()  # the worker records, the publishing thread retires
        self._version_series: dict[int, set[tuple[Gauge, tuple[str, ...]]]] = {}  # version -> its series
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

    def version_rewards(self, mode: str, version: int, rewards: Iterable[float]) -> None:
        """Count ``rewards`` of a group decided at policy ``version`` (not counted once the
        version's series is frozen: ``VERSION_SERIES_KEPT``)."""
        values = [v for v in rewards if v == v]
        labels = (mode, str(version))
        with self._series_lock:
            if not self._versioned(version, (self.version_reward_sum, labels), (self.version_reward_count, labels),
                                   (self.version_correct, labels)):
                return
            self.version_reward_sum.labels(*labels).inc(sum(values))
            self.version_reward_count.labels(*labels).inc(len(values))
            self.version_correct.labels(*labels).inc(sum(1 for v in values if v > 0))

    def weight_update(self, server: str, version: int, mode: str, ms: float) -> None:
        """An inference server's in-place load of ``version`` took ``ms`` (pause to resume)."""
        labels = (server, str(version), mode)
        with self._series_lock:
            if self._versioned(version, (self.weight_update_ms, labels)):
                self.weight_update_ms.labels(*labels).set(ms)

    def _versioned(self, version: int, *series: tuple[Gauge, tuple[str, ...]]) -> bool:
        """Register ``series`` under ``version``; False when that version's series are frozen."""
        self._newest_version = max(self._newest_version, version)
        if version <= self._newest_version - VERSION_SERIES_KEPT:
            return False
        self._version_series.setdefault(version, set()).update(series)
        return True

    def _retire_frozen_series(self) -> None:
        with self._series_lock:
            for version in [v for v in self._version_series if v <= self._newest_version - VERSION_SERIES_KEPT]:
                for gauge, labels in self._version_series.pop(version):
                    gauge.remove(*labels)

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
        """Every sample as a Metric record; the frozen versions' series go from the registry once
        they are in it (their last values)."""
        records = [metric_record(self.worker, name, value, labels, now_ms) for name, labels, value in self.samples()]
        self._retire_frozen_series()
        return records

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
