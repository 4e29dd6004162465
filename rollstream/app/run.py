"""`rollstream run`: the whole RLVR or agentic pipeline on one machine.

Starts one process per stage (RLVR: admission, aggregator, generation, reward; agentic:
group-queue, env), those that load a model first (unless they need the local vLLM server's address)
so their load overlaps the embedded broker's start, the others once the topics exist; publishes the
config's prompts or starts its env groups, and acts as the trainer's batch builder until
``max_steps`` batches are built. It cannot loop forever: RLVR's resampling budget
(``max_prompts_per_batch``) and the agentic replacement budget (``max_replaced_episodes`` per
group id) end a hopeless step with a ``batch_underfilled`` verdict, which ships a partial batch
(``min_fill_ratio``) or ends the run, and ``time_limit_s`` bounds the wall clock. When the
prompts (``num_epochs`` passes over them) run out first, admission's ``end_of_data`` verdict
ends the run at once with outcome ``end_of_data``, after a final partial batch when
``min_fill_ratio`` allows. The summary is computed from the topics afterwards.
"""

from __future__ import annotations

import functools
import json
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

import yaml
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from rollstream.app.processes import StageProcesses, stop_on_terminate
from rollstream.app.producer import produce_prompts, start_env_groups
from rollstream.app.render import print_summary
from rollstream.app.run_folder import make_room, mark_started
from rollstream.app.stages import MODEL_STAGES, Stage, pipeline_stages, preflight, start_metrics, start_trackers
from rollstream.config import AgenticConfig, Config
from rollstream.exceptions import DiskFull, StageConfigError, StageDied
from rollstream.kafka.admin import create_pipeline_topics, wait_for_broker
from rollstream.kafka.broker import EmbeddedBroker, free_port
from rollstream.kafka.cluster import Cluster
from rollstream.kafka.context import StageContext
from rollstream.kafka.topics import Topics
from rollstream.observability.trackers import Trackers
from rollstream.runtime import now_ms
from rollstream.tools.learning import final_round_done
from rollstream.kafka.readback import first_record_ms
from rollstream.tools.readback import read_values
from rollstream.tools.summary import startup_seconds, summarize_agentic, summarize_rlvr
from rollstream.inference.local_server import LocalInferenceServer, vllm_python

if TYPE_CHECKING:  # the trainer imports torch: only once the broker and the stages are starting
    from rollstream.trainer.loop import LoopResult


def run_pipeline(config: Config, summary_json: Path | None = None, console: Console | None = None,
                 run_dir: Path | None = None, report_html: Path | None = None, started_ms: int | None = None,
                 replace: bool = False) -> dict:
    """Run the pipeline in ``run_dir`` (default ``runs/<name>``); returns the summary dict (also
    written to ``summary_json``), and writes the HTML report (rollstream.tools.report) to
    ``report_html`` when given. A previous run in ``run_dir`` is kept as ``<run_dir>.<its
    start>``, or with ``replace`` deleted once this run has really started
    (rollstream.app.run_folder). ``started_ms`` (epoch ms; default: now) is where the summary's
    ``startup_seconds`` count from: `rollstream run` passes its process's start. SIGTERM or
    SIGHUP stops the stages, the server and the broker and raises SystemExit
    (``stop_on_terminate``)."""
    with stop_on_terminate():
        return _run_pipeline(config, summary_json, console, run_dir, report_html, started_ms, replace)


def _run_pipeline(config: Config, summary_json: Path | None, console: Console | None, run_dir: Path | None,
                  report_html: Path | None, started_ms: int | None, replace: bool) -> dict:
    console = console or Console()
    preflight(config)  # a bad env type or group filter fails now, before the broker starts
    started = time.monotonic()
    started_ms = now_ms() if started_ms is None else started_ms
    run_dir = run_dir or Path("runs") / config.name
    server = local_inference_server(config, run_dir / "logs" / "vllm-server.log")
    previous = make_room(run_dir)
    if previous is not None:
        console.print(f"the previous run is at {previous}" + (" (deleted once this one has started: --replace)"
                                                              if replace else ""))
    (run_dir / "logs").mkdir(parents=True)
    # The embedded broker's port is chosen now, so the stages that load a model can start before it is up.
    broker = EmbeddedBroker(run_dir / "kafka", port=free_port()) if config.kafka.bootstrap_servers is None else None
    bootstrap = broker.cluster if broker is not None else Cluster.from_config(config.kafka.bootstrap_servers,
                                                                              config.kafka)
    config_path = run_dir / "config.yaml"  # what every stage process reads
    topics = Topics(config.kafka.topic_prefix)
    stages = StageProcesses(config_path, bootstrap, run_dir / "logs", max_restarts=config.max_stage_restarts,
                            backoff_s=config.stage_restart_backoff_s,
                            on_restart=lambda line: console.print(f"[yellow]{line}[/]"),
                            env={BROKER_WAIT_ENV: str(BROKER_START_S)})
    trackers, summary = Trackers(), None
    try:
        try:
            # Without a vLLM server to wait for, the model stages start first: their engine loads
            # (the longest start-up) while the broker starts.
            early = () if server is not None else tuple(s for s in pipeline_stages(config) if s in MODEL_STAGES)
            if early:
                _write_config(config_path, config)
                for stage in early:
                    stages.start(stage)
            _start_broker(broker, bootstrap, console)
            broker_s = round((now_ms() - started_ms) / 1000, 2)
            if server is not None:
                with console.status("starting the local vLLM server"):
                    url = server.start(config.actor_infer.server.startup_timeout_s)
                console.print(f"local vLLM server at {url} (log {server.log_path})")
                config = with_servers(config, [url])
                _write_config(config_path, config)
            mark_started(run_dir, previous, replace)
            trackers = start_trackers(config, bootstrap, run_dir)
            supervised = Supervised(stages, server, console, DiskGuard.of(broker, config.kafka.disk_reserve_mb,
                                                                          topics.prefix))
            result = _build(config, bootstrap, topics, supervised, run_dir, console, started, early)
        except StageDied as exc:
            from rollstream.trainer.loop import LoopResult

            outcome = ("config_error" if isinstance(exc, StageConfigError) else "disk_full"
                       if isinstance(exc, DiskFull) else "stage_failed")
            result = LoopResult(outcome=outcome, detail=str(exc))
        finally:
            stages.close()
            if server is not None:
                server.stop()
        summarize = summarize_agentic if isinstance(config, AgenticConfig) else summarize_rlvr
        read = functools.cache(functools.partial(read_values, bootstrap))  # each topic read once
        from rollstream.trainer.manifest import Manifest  # with torch: imported late, as the trainer

        batches = Manifest(run_dir / "batches.jsonl").entries()  # this run's: the folder was new
        summary = summarize(config, bootstrap, topics, batches, result.outcome, result.detail,
                            time.monotonic() - started, read)
        summary["startup_seconds"] = {"broker": broker_s, **startup_seconds(
            bootstrap, topics, isinstance(config, AgenticConfig), started_ms, read)}
        summary["stage_restarts"] = dict(stages.restarts)
        if server is not None:
            summary["stage_restarts"]["vllm-server"] = server.restarts
        if report_html is not None:
            from rollstream.tools.report import write_report

            plots, with_data = write_report(bootstrap, topics, report_html, f"rollstream run {config.name}")
            console.print(f"report: {report_html} ({plots} plots, {with_data} with data)")
    finally:
        trackers.close(summary)  # the summary's figures end each series; reads the topics: before the broker stops
        if broker is not None:
            broker.stop()
    print_summary(summary, console)
    for path in {run_dir / "summary.json", *([summary_json] if summary_json else [])}:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2))
    return summary


# How long the embedded broker may take to answer, and so how long a stage started before it waits.
BROKER_START_S = 60
BROKER_WAIT_ENV = "ROLLSTREAM_BROKER_WAIT_S"


def _start_broker(broker: EmbeddedBroker | None, bootstrap: Cluster, console: Console) -> None:
    """Start the embedded ``broker`` (None: wait for the configured cluster ``bootstrap``).
    Raises BrokerStartError / BrokerUnreachableError."""
    if broker is None:
        wait_for_broker(bootstrap)
        return
    with console.status("starting the local Kafka broker"):
        broker.start(BROKER_START_S)
    console.print(f"local Kafka broker at {bootstrap} (log {broker.log_path})")


def _write_config(path: Path, config: Config) -> None:
    path.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))


def local_inference_server(config: Config, log_path: Path) -> LocalInferenceServer | None:
    """The vLLM server `rollstream run` starts: for ``vllm_server`` without ``actor_infer.servers``
    (not started yet). Raises ConfigError when no Python with vLLM is found."""
    actor_infer = config.actor_infer
    if actor_infer.backend != "vllm_server" or actor_infer.servers:
        return None
    from rollstream.policy.model import model_folder

    server = actor_infer.server
    return LocalInferenceServer(
        model_folder(config.infer_model_path), log_path, python=vllm_python(server.python), dtype=actor_infer.dtype,
        port=server.port, max_model_len=server.max_model_len, kv_cache_gb=server.kv_cache_gb,
        max_num_seqs=actor_infer.max_num_seqs, extra_args=server.extra_args, nice=actor_infer.nice)


def with_servers(config: Config, servers: list[str]) -> Config:
    """``config`` with ``actor_infer.servers`` set (the config is frozen: a copy)."""
    return config.model_copy(update={"actor_infer": config.actor_infer.model_copy(update={"servers": servers})})


class DiskGuard:
    """The embedded broker's disk, checked with the stages: below ``reserve_bytes`` free, raise
    DiskFull naming the largest topics, while Kafka can still write (on a full disk it takes its
    log directory offline and stops)."""

    def __init__(self, broker: EmbeddedBroker, reserve_bytes: int, prefix: str) -> None:
        self.broker, self.reserve_bytes, self.prefix = broker, reserve_bytes, prefix

    @classmethod
    def of(cls, broker: EmbeddedBroker | None, reserve_mb: int, prefix: str) -> "DiskGuard | None":
        return cls(broker, reserve_mb * 2**20, prefix) if broker is not None and reserve_mb > 0 else None

    def check(self) -> None:
        free = shutil.disk_usage(self.broker.data_dir).free
        if free >= self.reserve_bytes:
            return
        ours = [(topic, size) for topic, size in self.broker.topic_bytes().items() if topic.startswith(self.prefix)]
        largest = [f"{topic.removeprefix(self.prefix)} {size / 2**20:.1f} MiB" for topic, size in ours[:3]]
        raise DiskFull(f"the embedded broker's disk ({self.broker.data_dir}) has {free / 2**20:.0f} MiB free, below "
                       f"kafka.disk_reserve_mb {self.reserve_bytes // 2**20}; largest topics: {', '.join(largest)}. "
                       "Free space there (or run from a larger disk); payloads go once trained "
                       "(kafka.payload_retention_ms), checkpoints per actor_train.keep_checkpoints")


class Supervised:
    """The stage processes, the local vLLM server and the embedded broker's disk, checked
    together: a dead stage restarts or raises StageDied (StageProcesses.check), a dead server is
    started again on its port, a disk below its reserve raises DiskFull (``disk``)."""

    def __init__(self, stages: StageProcesses, server: LocalInferenceServer | None, console: Console,
                 disk: DiskGuard | None = None) -> None:
        self.stages, self.server, self.console, self.disk = stages, server, console, disk

    def start(self, stage) -> str:
        return self.stages.start(stage)

    def check(self, finished: frozenset[str] = frozenset()) -> None:
        self.stages.check(finished)
        if self.disk is not None:
            self.disk.check()
        if self.server is not None and self.server.restart_if_dead():
            self.console.print(f"[yellow]the vLLM server died; restart {self.server.restarts} on {self.server.url}[/]")


def _build(config: Config, bootstrap: Cluster, topics: Topics, stages: Supervised, run_dir: Path,
           console: Console, started: float, early: tuple[Stage, ...] = ()) -> LoopResult:
    create_pipeline_topics(bootstrap, config.kafka)
    for stage in pipeline_stages(config):
        if stage not in early:  # those started before the broker wait for the topics themselves
            stages.start(stage)
    if isinstance(config, AgenticConfig):
        n_groups = start_env_groups(config, bootstrap)
        console.print(f"started {n_groups} env groups on {topics.episodes_control}")
    else:
        n_prompts = produce_prompts(config, bootstrap)
        console.print(f"published {n_prompts} prompts to {topics.prompts}")
    target = config.max_steps * config.groups_per_batch
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total} groups"), TimeElapsedColumn(),
                  console=console) as progress:
        bar = progress.add_task(f"0 of {config.max_steps} steps trained", total=target)

        def show(result: LoopResult, buffered: int) -> None:  # groups in: trained, or buffered to be
            progress.update(bar, completed=min(target, result.groups + buffered),
                            description=f"{result.steps} of {config.max_steps} steps trained")

        metrics = start_metrics(StageContext(bootstrap, topics, "trainer"))
        # imported now, not with this module: torch's import would delay the broker and the stages
        from rollstream.trainer.driver import run_trainer

        try:
            first_output = topics.trajectories if isinstance(config, AgenticConfig) else topics.responses
            result = run_trainer(config, bootstrap, run_dir, deadline=started + config.time_limit_s,
                                 check=stages.check, on_progress=show,
                                 # the model loads once generation has started, not against its start
                                 load_when=lambda: first_record_ms(bootstrap, first_output) is not None)
        finally:
            metrics.close()
    if not isinstance(config, AgenticConfig) and config.eval_steps and result.outcome in ("complete", "end_of_data"):
        _await_final_validation(config, bootstrap, topics, stages, console, min(
            started + config.time_limit_s, time.monotonic() + FINAL_VALIDATION_WAIT_S))
    return result


FINAL_VALIDATION_WAIT_S = 600.0


def _await_final_validation(config: Config, bootstrap: Cluster, topics: Topics, stages: Supervised,
                            console: Console, deadline: float) -> None:
    """With ``eval_steps``, the trainer's last version may be due a validation round the stages
    are still generating: wait for it (bounded by ``deadline``) so the learning curve ends there."""
    versions = [p["version"] for p in read_values(bootstrap, topics.policy_versions)]
    last = max(versions, default=0)
    with console.status(f"validating policy version {last}"):
        while not final_round_done(read_values(bootstrap, topics.groups_validation), config.eval_steps, last):
            if time.monotonic() > deadline:
                console.print(f"[yellow]the validation round of policy version {last} did not finish in time[/]")
                return
            stages.check()
            time.sleep(1.0)
