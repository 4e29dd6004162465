"""Does anything grow in a long run, and does every fault, coming again and again, heal? The RLVR
pipeline for ``--minutes`` (default 60) on this machine, every stage its own supervised process
(admission, aggregator, generation, reward, trainer: what `rollstream run` starts, the trainer
included), faults injected on a schedule, the processes and the broker sampled all along.

Two trainers (``--trainer``):

* ``cheap`` (default): a random-weights Qwen2 of width 32 (the bundled tokenizer) generates and
  trains: every step is real (loss, optimizer, checkpoint, a new policy version the generation
  worker loads) but costs about a second, so the stream side carries the load. Its replies hold
  no answer, so the reward is a coin fixed by the reply's text (benchmarks/soak_rewards.py): a
  group of 4 is all-equal with chance 1/8 and the mean filter rejects it, so resampling runs.
* ``model``: the bundled SmolLM2-135M on one-digit sums, scored by the reply's last number.

The soak produces the prompts itself (one-digit sums from reasoning-gym, each copy a new
prompt_id), keeping ``BACKLOG`` prompts ahead of the decisions, and ends the data after
``--minutes``; the trainer then ends ``end_of_data`` and ``rollstream audit`` checks the topics.

Faults, one every ``--fault-every-s`` after ``--warmup-s``, in ``FAULT_KINDS`` order round and
round: each stage SIGKILLed (the supervisor restarts it), the broker stopped for 5 s and started,
a reward call that hangs past its timeout, a burst of ``BURST`` malformed events on the prompts
and responses.rewarded topics. A fault's ``recovered_s``: from the fault to the first committed
batch holding a group the aggregator decided after the fault was over (the killed stage running
again, the broker back, the hung call's timeout passed, the burst written); ``RECOVERY_BOUND_S``
bounds it. There is no inference server in this pipeline (transformers in the generation stage),
so no server fault.

Sampled every ``--sample-every-s`` (default 60): RSS, threads and open files of each stage's
process tree (the reward pool's processes counted with the reward stage) and of the broker;
bytes on the broker's disk per topic; each consumer group's lag; decisions (groups accepted and
rejected) per second. Per window of ``--window-s`` from the warm-up's end (default: one round of
the faults, so the first and the last window compared hold the same faults): the latency from a
group's decision to the commit of the batch holding it, p50 and p99 (from the trainer's
manifest), and the mean lag. Slopes per hour, by least squares after the warm-up; a stage's RSS
slope is fitted to its floor (the lowest of the readings every ``FLOOR_EVERY_S`` since the last
sample) within each process's life (a restart starts a new line: the pooled within-process
slope), leaving ``RSS_SETTLE_S`` of each life out.
JSON to ``--out`` (time series, slopes, faults, goals), a PNG to ``--plot``. Never asserts on
time; ``goals`` says which targets held.

    .venv/bin/python benchmarks/soak.py [--minutes 60] [--trainer cheap|model] [--out runs/bench/soak.json]
        [--plot docs/img/soak.png]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import yaml
from kafka import KafkaAdminClient, TopicPartition

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.tiny_models: the cheap trainer's random-weights model

from rollstream.app.processes import StageProcesses  # noqa: E402
from rollstream.app.stages import Stage  # noqa: E402
from rollstream.config import DatasetConfig, load_config  # noqa: E402
from rollstream.data import dataset_prompts, publish_end, publish_prompts  # noqa: E402
from rollstream.kafka.admin import create_pipeline_topics  # noqa: E402
from rollstream.kafka.broker import EmbeddedBroker  # noqa: E402
from rollstream.kafka.clients import make_producer, reader_consumer  # noqa: E402
from rollstream.kafka.topics import TOPICS, Topics  # noqa: E402
from rollstream.schemas import encode  # noqa: E402
from rollstream.tools.audit import run_audit  # noqa: E402
from rollstream.tools.readback import read_values  # noqa: E402
from rollstream.tools.stats import percentiles  # noqa: E402

STAGES = (Stage.admission, Stage.aggregator, Stage.generation, Stage.reward, Stage.trainer)
FAULT_KINDS = (*(f"kill:{s.value}" for s in STAGES), "broker", "reward_hang", "malformed")
DOMAIN = "arithmetic"
REWARD_TIMEOUT_S = 5.0
HANG_S = 3 * REWARD_TIMEOUT_S  # a hung call sleeps this long: the pool must kill it at the timeout
BROKER_DOWN_S = 5.0
BURST = 20  # malformed events per topic per burst
BACKLOG = 32  # prompts produced ahead of the decisions
# Each process's first minutes are not a leak: imports, the model, the allocator's arenas filling
# (a trainer was seen to climb ~10 MB over its first 10-15 minutes after a restart)
RSS_SETTLE_S = 600.0
FLOOR_EVERY_S = 5.0  # RSS readings between samples, for each process's floor (RssFloor)
# Seconds from a fault to the first batch of groups decided after it: a stage's restart (backoff,
# imports; a model stage loads its model), a batch to fill, generous for 2 shared cores.
RECOVERY_BOUND_S = {"kill:admission": 90, "kill:aggregator": 90, "kill:generation": 120, "kill:reward": 90,
                    "kill:trainer": 120, "broker": 120, "reward_hang": 90, "malformed": 60}
GOAL_RSS_MB_PER_H = 5.0
PAYLOAD_RETENTION_MS = 60_000  # short: the trainer, not the clock, decides what goes (and it is killed too)
PROBE_TIMEOUT_MS = 15_000
SMOKE_FAULTS = "kill:aggregator,malformed,reward_hang"


@dataclass
class Fault:
    kind: str
    at_s: float  # when it was injected, seconds after the soak started
    over_s: float | None = None  # when it was over (restarted, broker back, timeout passed, burst written)
    recovered_s: float | None = None  # seconds from at_s to the first batch of groups decided after over_s
    bound_s: float = 0.0


# -- the pipeline ----------------------------------------------------------------------------------

def soak_config(workdir: Path, name: str, trainer: str, minutes: float) -> Path:
    """Write the soak's config (and its reward module beside it) under ``workdir``."""
    cheap = trainer == "cheap"
    config = {
        "name": name, "seed": 1,
        # payloads kept a minute past their use; segments roll each minute, so deleted ones free disk
        "kafka": {"topic_prefix": f"{name}.", "partitions": 2, "payload_retention_ms": PAYLOAD_RETENTION_MS,
                  "topic_configs": {"responses": {"segment.ms": 60_000, "segment.bytes": 1_048_576}}},
        "rollout_batch_size": 4, "num_return_sequences_in_group": 4, "max_running_prompts": 8,
        "max_prompts_per_batch": 64, "max_steps": 10_000_000, "time_limit_s": minutes * 60 + 1800,
        "prompt_timeout_s": 60, "max_stage_restarts": 100, "stage_restart_backoff_s": 0.5,
        "actor_infer": {"max_batch": 16, "generating_args": {"temperature": 1.0, "max_new_tokens": 8 if cheap else 16}},
        "actor_train": {"lr": 1.0e-5, "micro_batch_size": 4, "keep_checkpoints": 2},
        "reward_concurrency": 2,
        "rewards": {DOMAIN: {
            "reward_type": f"soak_rewards:{'coin' if cheap else 'last_number'}", "reward_timeout_s": REWARD_TIMEOUT_S,
            "query_filter_config": {"type": "mean_filter", "filter_args": {"threshold_down": 0.0, "threshold_up": 1.0}},
            "response_filter_config": {"type": "default", "filter_args": {"reject_truncated": False,
                                                                          "reject_empty": False}}}},
        "datasets": [],
    }
    if cheap:
        from tests.tiny_models import build_tiny_qwen2

        config["pretrain"] = str(build_tiny_qwen2(workdir / "tiny-qwen2"))
    shutil.copy(Path(__file__).with_name("soak_rewards.py"), workdir / "soak_rewards.py")
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def prompt_pool(seed: int = 1, size: int = 512) -> list[dict]:
    """One-digit sums, the Prompt records the soak sends again and again under new ids."""
    dataset = DatasetConfig(source="reasoning-gym/basic_arithmetic", domain=DOMAIN, num_samples=size,
                            config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})
    return dataset_prompts(dataset, seed)


class PromptFeed:
    """Keeps ``BACKLOG`` prompts produced ahead of the decided ones; ``end`` sends the marker."""

    def __init__(self, bootstrap: str, topics: Topics) -> None:
        self.topics, self.pool, self.sent = topics, prompt_pool(), 0
        self.producer = make_producer(bootstrap)

    def top_up(self, decided: int) -> None:
        records = []
        while self.sent + len(records) < decided + BACKLOG:
            n = self.sent + len(records)
            base = self.pool[n % len(self.pool)]
            records.append({**base, "prompt_id": f"{base['prompt_id']}~{n // len(self.pool)}"})
        if records:
            self.sent += publish_prompts(self.producer, self.topics, records)
            self.producer.flush()

    def burst(self) -> None:
        """``BURST`` malformed events on prompts and on responses.rewarded: random bytes, and a
        Prompt cut in half (prompts) or whole (responses.rewarded: another schema than its own);
        each must be dead-lettered with its reason."""
        rng = random.Random(self.sent)
        valid = encode({**self.pool[0], "prompt_id": "soak-malformed", "created_ms": 0}, "Prompt")
        for topic, other in ((self.topics.prompts, valid[: len(valid) // 2]), (self.topics.responses_rewarded, valid)):
            for n in range(BURST):
                value = rng.randbytes(rng.randint(1, 200)) if n % 2 else other
                self.producer.send(topic, key=b"soak-malformed", value=value)
        self.producer.flush()

    def end(self) -> None:
        publish_end(self.producer, self.topics, self.sent, "soak")
        self.producer.flush()

    def close(self) -> None:
        self.producer.close()


# -- sampling --------------------------------------------------------------------------------------

def tree_figures(pid: int) -> dict | None:
    """RSS (MB), threads and open files of process ``pid`` and its descendants; None when gone."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    rss = threads = fds = 0
    for proc in procs:
        try:
            with proc.oneshot():
                rss, threads, fds = rss + proc.memory_info().rss, threads + proc.num_threads(), fds + proc.num_fds()
        except psutil.Error:  # a pool process that ended meanwhile
            continue
    return {"pid": pid, "rss_mb": round(rss / 2**20, 1), "threads": threads, "fds": fds}


class RssFloor:
    """Each stage process tree's lowest RSS (MB) between two samples. A leak raises the floor; a
    batch's transient tensors raise single readings by tens of MB and do not, so slopes are fitted
    to the floor."""

    def __init__(self) -> None:
        self._low: dict[tuple[str, int], float] = {}

    def observe(self, stages: StageProcesses) -> None:
        for name, proc in stages.procs.items():
            if figures_ := tree_figures(proc.pid):
                key = (name, figures_["pid"])
                self._low[key] = min(self._low.get(key, figures_["rss_mb"]), figures_["rss_mb"])

    def take(self, name: str, pid: int) -> float | None:
        """The floor of ``name``'s process ``pid`` since the last take; None if never observed."""
        return self._low.pop((name, pid), None)


def topic_label(topic: str, prefix: str) -> str:
    """The name a topic's bytes are reported under: the run's topics by logical name, the tables'
    changelogs together as ``changelogs``, the broker's own (``__consumer_offsets``,
    ``__cluster_metadata``) by name, anything else (faust's assignor topics) as ``(other)``."""
    logical = topic.removeprefix(prefix)
    if topic.startswith(prefix) and logical in TOPICS:
        return logical
    if topic.endswith("-changelog"):
        return "changelogs"
    return topic if topic.startswith("__") else "(other)"


def disk_by_topic(broker: EmbeddedBroker, prefix: str) -> dict[str, int]:
    """Bytes on the broker's disk by ``topic_label``."""
    out: dict[str, int] = {}
    for topic, size in broker.topic_bytes().items():
        name = topic_label(topic, prefix)
        out[name] = out.get(name, 0) + size
    return dict(sorted(out.items()))


class BrokerProbe:
    """The soak's own clients: end offsets per topic and each consumer group's lag. Every call
    answers None while the broker is away (the broker fault)."""

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        # short timeouts: a call made as the broker goes away fails in seconds, not minutes
        self.consumer = reader_consumer(bootstrap, request_timeout_ms=PROBE_TIMEOUT_MS)
        self.admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="rollstream-soak",
                                      request_timeout_ms=PROBE_TIMEOUT_MS)

    def end_offsets(self, topics: list[str]) -> dict[str, int] | None:
        try:
            tps = [TopicPartition(t, p) for t in topics for p in sorted(self.consumer.partitions_for_topic(t) or ())]
            ends = self.consumer.end_offsets(tps)
        except Exception:  # the broker is away
            return None
        return {t: sum(v for tp, v in ends.items() if tp.topic == t) for t in topics}

    def lag(self) -> dict[str, int] | None:
        """Per consumer group: the records after its committed offsets, summed over partitions."""
        try:
            groups = sorted(g["group_id"] for g in self.admin.list_groups())
            committed = self.admin.list_group_offsets(groups) if groups else {}
            tps = sorted({tp for offsets in committed.values() for tp in offsets})
            ends = self.consumer.end_offsets(tps) if tps else {}
        except Exception:
            return None
        return {g: sum(max(0, ends[tp] - om.offset) for tp, om in offsets.items() if om.offset >= 0)
                for g, offsets in committed.items()}

    def close(self) -> None:
        self.consumer.close()
        self.admin.close()


class ManifestTail:
    """The trainer's manifest, read as it grows (whole lines only: the trainer may be writing the
    last): per committed group, when the aggregator decided it and when its batch was committed
    (epoch ms)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, 0
        self.groups: list[tuple[int, int]] = []  # (decided_ms, committed_ms)

    def poll(self) -> None:
        if not self.path.exists():
            return
        with self.path.open("rb") as fh:
            fh.seek(self.offset)
            chunk = fh.read()
        lines = chunk.split(b"\n")[:-1]  # the part after the last newline is not whole yet
        self.offset += sum(len(line) + 1 for line in lines)
        for line in lines:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:  # a line torn by a SIGKILLed trainer
                continue
            for arrived, lag in zip(entry.get("arrived_ms", []), entry.get("arrival_lag_ms", [])):
                if lag is not None:
                    self.groups.append((arrived - lag, entry["created_ms"]))

    def first_commit_of_groups_decided_after(self, ms: int) -> int | None:
        return min((committed for decided, committed in self.groups if decided >= ms), default=None)


# -- faults ----------------------------------------------------------------------------------------

class Injector:
    """Injects one fault kind and tells when it is over."""

    def __init__(self, stages: StageProcesses, broker: EmbeddedBroker, feed: PromptFeed, hang_flag: Path) -> None:
        self.stages, self.broker, self.feed, self.hang_flag = stages, broker, feed, hang_flag
        self._over: dict[int, float] = {}  # id(fault) -> epoch s when it was over

    def inject(self, fault: Fault, killed_pid: dict[int, int]) -> None:
        if fault.kind.startswith("kill:"):
            proc = self.stages.procs[fault.kind.split(":", 1)[1]]
            killed_pid[id(fault)] = proc.pid
            os.kill(proc.pid, signal.SIGKILL)
        elif fault.kind == "broker":
            def bounce() -> None:
                self.broker.stop()
                time.sleep(BROKER_DOWN_S)
                self.broker.start(timeout=120)
                self._over[id(fault)] = time.time()
            threading.Thread(target=bounce, daemon=True).start()
        elif fault.kind == "reward_hang":
            self.hang_flag.touch()
            self._over[id(fault)] = time.time() + REWARD_TIMEOUT_S  # a hung call is cut at its timeout
        elif fault.kind == "malformed":
            self.feed.burst()
            self._over[id(fault)] = time.time()
        else:
            raise ValueError(f"unknown fault {fault.kind!r}; known: {FAULT_KINDS}")

    def over_at(self, fault: Fault, killed_pid: dict[int, int]) -> float | None:
        """Epoch seconds when ``fault`` was over, None while it is not."""
        if fault.kind.startswith("kill:"):
            proc = self.stages.procs[fault.kind.split(":", 1)[1]]
            if proc.pid != killed_pid[id(fault)] and proc.poll() is None and id(fault) not in self._over:
                self._over[id(fault)] = time.time()
        if fault.kind == "reward_hang" and self.hang_flag.exists():
            return None  # no call has found the flag yet: the hang has not begun
        return self._over.get(id(fault))


# -- figures ---------------------------------------------------------------------------------------

def slope_per_hour(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, value) points, per hour; None for fewer than 3 points."""
    if len(points) < 3 or len({t for t, _ in points}) < 2:
        return None
    return statistics.linear_regression([t for t, _ in points], [v for _, v in points]).slope * 3600


def within_lives_slope_per_hour(points: list[tuple[float, int, float]]) -> float | None:
    """The pooled within-process slope of (seconds, pid, value) points, per hour: each pid's own
    line, one common slope (the restarts' drops are not a trend). None without 3 points in a life."""
    lives: dict[int, list[tuple[float, float]]] = {}
    for t, pid, v in points:
        lives.setdefault(pid, []).append((t, v))
    num = den = 0.0
    for life in (ps for ps in lives.values() if len(ps) >= 3):
        mt, mv = statistics.fmean(t for t, _ in life), statistics.fmean(v for _, v in life)
        num += sum((t - mt) * (v - mv) for t, v in life)
        den += sum((t - mt) ** 2 for t, _ in life)
    return num / den * 3600 if den else None


def figures(samples: list[dict], latency: list[dict], faults: list[Fault], warmup_s: float, window_s: float,
            duration_s: float) -> dict:
    """The report's slopes and first/last comparisons from the time series; the latency windows
    compared are the first and the last that start after the warm-up, the last one cut by the
    data's end if at least half of it came before."""
    after = [s for s in samples if s["t_s"] >= warmup_s]
    rss_slope, fd_slope = {}, {}
    for name in sorted({n for s in samples for n in s["processes"]}):
        points = []
        born: dict[int, float] = {}
        for s in after:
            proc = s["processes"].get(name)
            if proc:
                born.setdefault(proc["pid"], s["t_s"])
                if s["t_s"] - born[proc["pid"]] >= RSS_SETTLE_S:
                    points.append((s["t_s"], proc["pid"], proc))
        slope = within_lives_slope_per_hour([(t, pid, p.get("rss_floor_mb", p["rss_mb"])) for t, pid, p in points])
        rss_slope[name] = None if slope is None else round(slope, 2)
        slope = within_lives_slope_per_hour([(t, pid, p["fds"]) for t, pid, p in points])
        fd_slope[name] = None if slope is None else round(slope, 2)
    lags = [s for s in after if s["lag"] is not None]
    # bytes a response takes on the broker: before the trainer first deletes payloads
    kept = []
    for s in samples:
        size = s["disk_bytes"].get("responses", 0)
        if kept and size < kept[-1][0]:
            break
        if s["responses_written"]:
            kept.append((size, s["responses_written"]))
    disks = [s for s in samples if s["disk_bytes"]]
    windows = [w for w in latency if w["groups"] and w["from_s"] >= warmup_s
               and w["from_s"] + window_s / 2 <= duration_s]  # the last may be cut by the data's end
    return {
        "rss_slope_mb_per_h": rss_slope, "fds_slope_per_h": fd_slope,
        "lag_slope_per_h": {g: round(v, 1) for g in sorted({g for s in lags for g in s["lag"]})
                            if (v := slope_per_hour([(s["t_s"], s["lag"].get(g, 0)) for s in lags])) is not None},
        "lag": window_means(lags, windows, window_s) if windows else None,
        "disk_bytes_by_topic": {"first": disks[0]["disk_bytes"], "last": disks[-1]["disk_bytes"]} if disks else None,
        "p99_latency_ms": {"first_window": windows[0]["p99"], "last_window": windows[-1]["p99"]} if windows else None,
        "decisions_per_s": {"first": after[1]["decisions_per_s"], "last": after[-1]["decisions_per_s"]}
        if len(after) > 1 else None,
        "bytes_per_response": round(statistics.median(size / n for size, n in kept), 1) if kept else None,
        "faults_recovered": sum(f.recovered_s is not None for f in faults),
        "faults_within_bound": sum(f.recovered_s is not None and f.recovered_s <= f.bound_s for f in faults),
    }


def window_means(samples: list[dict], windows: list[dict], window_s: float) -> dict:
    """Each consumer group's mean lag over the samples of the first and of the last compared
    window (records)."""
    def mean(window: dict) -> dict[str, float]:
        inside = [s["lag"] for s in samples if window["from_s"] <= s["t_s"] < window["from_s"] + window_s]
        groups = sorted({g for lag in inside for g in lag})
        return {g: round(statistics.fmean(lag.get(g, 0) for lag in inside), 1) for g in groups} if inside else {}
    return {"first_window": mean(windows[0]), "last_window": mean(windows[-1])}


def latency_windows(groups: list[tuple[int, int]], start_ms: int, window_s: float, offset_s: float = 0.0) -> list[dict]:
    """Decision -> batch commit latency per window of ``window_s`` from ``offset_s`` (by commit
    time), and of what came before it (from 0): groups, p50, p99 (ms)."""
    windows: dict[int, list[float]] = {}
    for decided, committed in groups:
        n = int(((committed - start_ms) / 1000 - offset_s) // window_s)
        windows.setdefault(max(n, -1), []).append(committed - decided)  # -1: everything before offset_s
    return [{"from_s": offset_s + n * window_s if n >= 0 else 0.0, "groups": len(v), **{k: percentiles(v)[k] for k in ("p50", "p99")}}
            for n, v in sorted(windows.items())]


def goals(report: dict) -> dict:
    """Which of the soak's targets held."""
    rss = [v for name, v in report["rss_slope_mb_per_h"].items() if v is not None and name != "broker"]
    latency, lag = report["p99_latency_ms"], report["lag"]
    return {
        "audit_ok": report["audit_ok"],
        "no_accepted_group_lost_to_retention": (report["counts"] or {}).get("groups_rejected_by_trainer") == 0,
        "stage_rss_slope_at_most_5_mb_per_h": bool(rss) and max(rss) <= GOAL_RSS_MB_PER_H,
        "every_fault_recovered_within_bound": report["faults_within_bound"] == len(report["faults"]),
        "dead_letters_are_the_bursts": report["events_dead_lettered"] == report["malformed_sent"],
        "p99_latency_last_window_at_most_first_x1.5": bool(latency) and latency["last_window"] <= 1.5 * latency[
            "first_window"],
        "lag_last_window_at_most_first_x1.5_plus_backlog": bool(lag) and sum(lag["last_window"].values()) <= 1.5 * sum(
            lag["first_window"].values()) + BACKLOG,
    }


# -- the soak --------------------------------------------------------------------------------------

def sample(t_s: float, stages: StageProcesses, broker: EmbeddedBroker, probe: BrokerProbe, topics: Topics,
           previous: dict | None, floor: RssFloor) -> dict:
    up = broker.is_running()
    ends = probe.end_offsets([topics.groups_accepted, topics.groups_rejected, topics.responses]) if up else None
    decided = ends[topics.groups_accepted] + ends[topics.groups_rejected] if ends else (previous or {}).get("decided")
    processes = {name: figures_ for name, proc in stages.procs.items() if (figures_ := tree_figures(proc.pid))}
    for name, figures_ in processes.items():
        low = floor.take(name, figures_["pid"])
        figures_["rss_floor_mb"] = figures_["rss_mb"] if low is None else min(low, figures_["rss_mb"])
    if broker.is_running() and (figures_ := tree_figures(broker.pid)):
        processes["broker"] = figures_
    rate = None
    if previous and decided is not None and previous.get("decided") is not None:
        rate = round((decided - previous["decided"]) / max(1e-9, t_s - previous["t_s"]), 2)
    return {"t_s": round(t_s, 1), "processes": processes, "lag": probe.lag() if up else None, "decided": decided,
            "responses_written": ends[topics.responses] if ends else None,
            "decisions_per_s": rate, "disk_bytes": disk_by_topic(broker, topics.prefix)}


def soak(args: argparse.Namespace, workdir: Path) -> dict:
    name = f"soak-{args.trainer}-{uuid.uuid4().hex[:6]}"
    config_path = soak_config(workdir, name, args.trainer, args.minutes)
    config = load_config(config_path)
    topics = Topics(config.kafka.topic_prefix)
    broker = EmbeddedBroker(workdir / "kafka")
    broker.properties["log.retention.check.interval.ms"] = "30000"  # segments below the log start go soon
    bootstrap = broker.start(timeout=120)
    create_pipeline_topics(bootstrap, config.kafka)
    hang_flag = workdir / "hang.flag"
    (workdir / "logs").mkdir()
    stages = StageProcesses(config_path, bootstrap, workdir / "logs", max_restarts=config.max_stage_restarts,
                            backoff_s=config.stage_restart_backoff_s, cwd=workdir,
                            env={"SOAK_HANG_FLAG": str(hang_flag), "SOAK_HANG_S": str(HANG_S)})
    feed, probe = PromptFeed(bootstrap, topics), BrokerProbe(bootstrap)
    tail = ManifestTail(workdir / "runs" / name / "batches.jsonl")
    injector = Injector(stages, broker, feed, hang_flag)
    faults: list[Fault] = []
    killed: dict[int, int] = {}
    samples: list[dict] = []
    start, start_ms = time.monotonic(), int(time.time() * 1000)
    outcome = "error"
    try:
        for stage in STAGES:
            stages.start(stage)
        duration, decided = args.minutes * 60, 0
        next_sample, next_fault, next_floor, floor = 0.0, args.warmup_s, 0.0, RssFloor()
        while (t := time.monotonic() - start) < duration:
            stages.check(finished=frozenset({"trainer"}))
            if broker.is_running():  # the broker fault: nothing is produced while it is away
                decided = decided_now(probe, topics, decided)
                feed.top_up(decided)
            if t >= next_sample:
                samples.append(sample(t, stages, broker, probe, topics, samples[-1] if samples else None, floor))
                next_sample += args.sample_every_s
                print(json.dumps({"t_s": samples[-1]["t_s"], "decided": samples[-1]["decided"],
                                  "rss_mb": {n: p["rss_mb"] for n, p in samples[-1]["processes"].items()}}), flush=True)
            if t >= next_fault and duration - t > args.fault_every_s / 2:
                fault = Fault(args.faults[len(faults) % len(args.faults)], round(t, 1))
                fault.bound_s = RECOVERY_BOUND_S[fault.kind]
                injector.inject(fault, killed)
                faults.append(fault)
                next_fault += args.fault_every_s
            if t >= next_floor:
                floor.observe(stages)
                next_floor += FLOOR_EVERY_S
            tail.poll()
            track_recovery(faults, injector, killed, tail, start)
            time.sleep(1.0)
        feed.end()
        outcome = await_trainer(stages, workdir / "logs" / "trainer.log", args.end_timeout_s)
        tail.poll()
        track_recovery(faults, injector, killed, tail, start)
    finally:
        stages.close()
        feed.close()
        probe.close()
    try:
        audit = run_audit(bootstrap, topics, False, workdir / "runs" / name / "batches.jsonl")
        letters = {(d["source_topic"], d["partition"], d["offset"]) for d in read_values(bootstrap, topics.dead_letter)}
    finally:
        broker.stop()
    latency = latency_windows(tail.groups, start_ms, args.window_s, args.warmup_s)
    report = {
        "smoke": args.smoke, "trainer": args.trainer, "minutes": args.minutes,
        "duration_s": round(time.monotonic() - start, 1),
        "outcome": outcome, "audit_ok": audit.ok, "failed_checks": [c.name for c in audit.failed],
        "counts": audit.counts, "dead_letters": audit.dead_letters, "events_dead_lettered": len(letters),
        "malformed_sent": BURST * 2 * sum(f.kind == "malformed" for f in faults), "prompts_sent": feed.sent,
        "stage_restarts": dict(stages.restarts), "faults": [asdict(f) for f in faults],
        "settings": {k: getattr(args, k) for k in ("sample_every_s", "fault_every_s", "warmup_s", "window_s",
                                                   "faults")},
        "latency_windows": latency, "samples": samples,
    }
    report.update(figures(samples, latency, faults, args.warmup_s, args.window_s, args.minutes * 60))
    report["goals"] = goals(report)
    return report


def decided_now(probe: BrokerProbe, topics: Topics, fallback: int) -> int:
    ends = probe.end_offsets([topics.groups_accepted, topics.groups_rejected])
    return sum(ends.values()) if ends else fallback


def track_recovery(faults: list[Fault], injector: Injector, killed: dict[int, int], tail: ManifestTail,
                   start: float) -> None:
    """Stamp each open fault's ``over_s`` and ``recovered_s`` as they happen."""
    epoch_start = time.time() - (time.monotonic() - start)
    for fault in faults:
        if fault.recovered_s is not None:
            continue
        over = injector.over_at(fault, killed)
        if over is None:
            continue
        fault.over_s = round(over - epoch_start, 1)
        committed = tail.first_commit_of_groups_decided_after(int(over * 1000))
        if committed is not None:
            fault.recovered_s = round(committed / 1000 - epoch_start - fault.at_s, 1)


def await_trainer(stages: StageProcesses, log: Path, timeout_s: float) -> str:
    """Wait for the trainer to end after the end marker; its outcome (``error`` past the timeout)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stages.check(finished=frozenset({"trainer"}))
        if stages.procs["trainer"].poll() == 0:
            finished = [line for line in log.read_text(errors="replace").splitlines() if "trainer finished:" in line]
            return finished[-1].split("trainer finished:")[1].split()[0] if finished else "error"
        time.sleep(1.0)
    return "error"


def plot(report: dict, path: Path) -> None:
    """RSS per process, disk per topic, lag per group and latency p99 per window, against
    minutes, with the faults as ticks along the top panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = report["samples"]
    minutes = [s["t_s"] / 60 for s in samples]
    fig, axes = plt.subplots(4, 1, figsize=(9, 11), sharex=True)
    for name in sorted({n for s in samples for n in s["processes"]}):
        axes[0].plot(minutes, [s["processes"].get(name, {}).get("rss_mb") for s in samples], label=name)
    for fault in report["faults"]:
        axes[0].axvline(fault["at_s"] / 60, color="grey", alpha=0.3, linewidth=0.8)
    axes[0].set_ylabel("RSS (MB)")
    for topic in sorted({t for s in samples for t in s["disk_bytes"]}):
        axes[1].plot(minutes, [s["disk_bytes"].get(topic, 0) / 2**20 for s in samples], label=topic)
    axes[1].set_ylabel("broker disk (MiB)")
    for group in sorted({g for s in samples if s["lag"] for g in s["lag"]}):
        axes[2].plot(minutes, [(s["lag"] or {}).get(group) for s in samples], label=group.split(".")[-1])
    axes[2].set_ylabel("consumer lag (records)")
    windows = report["latency_windows"]
    axes[3].plot([w["from_s"] / 60 for w in windows], [w["p99"] for w in windows], "o-", label="p99")
    axes[3].plot([w["from_s"] / 60 for w in windows], [w["p50"] for w in windows], "o-", label="p50")
    axes[3].set_ylabel("decision -> batch (ms)")
    axes[3].set_xlabel("minutes")
    for ax in axes:
        ax.legend(fontsize=6, ncol=3)
    fig.suptitle(f"soak: {report['minutes']:g} min, trainer {report['trainer']}, {len(report['faults'])} faults "
                 "(grey lines)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--trainer", choices=("cheap", "model"), default="cheap")
    parser.add_argument("--sample-every-s", type=float, default=60.0)
    parser.add_argument("--fault-every-s", type=float, default=225.0,
                        help="a round of the faults every len(faults) x this: at 225 s a stage lives 30 minutes "
                        "between its kills, long enough to fit its RSS after RSS_SETTLE_S")
    parser.add_argument("--warmup-s", type=float, default=300.0, help="no fault and no slope before it")
    parser.add_argument("--window-s", type=float, default=None, help="latency percentiles and lag per window, "
                        "from the warm-up's end (default: a round of the faults, so every window holds the same ones)")
    parser.add_argument("--end-timeout-s", type=float, default=600.0, help="the trainer's end after the marker")
    parser.add_argument("--faults", default=",".join(FAULT_KINDS), help="kinds, injected in this order round and round")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/soak.json"))
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="make test's size: a minute, three faults")
    parser.add_argument("--check", action="store_true", help="exit 1 unless nothing was lost: the run ended "
                        "end_of_data, the audit passed, every malformed event was dead-lettered, no accepted group "
                        "lost (timings are never checked)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.minutes, args.sample_every_s, args.warmup_s, args.fault_every_s, args.window_s = 1.0, 5.0, 10.0, 15.0, 20.0
        args.faults = SMOKE_FAULTS
    args.faults = args.faults.split(",")
    if args.window_s is None:
        args.window_s = len(args.faults) * args.fault_every_s
    unknown = sorted(set(args.faults) - set(FAULT_KINDS))
    if unknown:
        parser.error(f"unknown faults {unknown}; known: {list(FAULT_KINDS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    with tempfile.TemporaryDirectory(prefix="rollstream-soak-") as tmp:
        report = soak(args, Path(tmp))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        plot(report, args.plot)
    print(json.dumps({k: v for k, v in report.items() if k not in ("samples", "latency_windows")}, indent=2))
    lost = [g for g in ("audit_ok", "no_accepted_group_lost_to_retention", "dead_letters_are_the_bursts")
            if not report["goals"][g]]
    if args.check and (report["outcome"] != "end_of_data" or lost):
        print(f"soak check failed: outcome {report['outcome']}, {lost}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
