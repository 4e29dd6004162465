"""Start one pipeline stage in this process: what `rollstream worker <stage>` runs."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from enum import Enum
from pathlib import Path

import faust

from rollstream.config import AgenticConfig, Config
from rollstream.exceptions import ConfigError
from rollstream.filtering.group_filters import load_group_filter
from rollstream.kafka import names
from rollstream.kafka.admin import create_changelog_topics
from rollstream.kafka.cluster import Bootstrap
from rollstream.kafka.clients import make_producer
from rollstream.kafka.context import StageContext
from rollstream.kafka.topics import Topics
from rollstream.observability.trackers import Trackers, check_installed
from rollstream.workers.envs import resolve_env

log = logging.getLogger(__name__)


class Stage(str, Enum):
    admission = "admission"
    aggregator = "aggregator"
    generation = "generation"
    reward = "reward"
    group_queue = "group-queue"
    env = "env"
    trainer = "trainer"


# What `rollstream run` starts as processes; it is the trainer itself.
RLVR_STAGES = (Stage.admission, Stage.aggregator, Stage.generation, Stage.reward)
AGENTIC_STAGES = (Stage.group_queue, Stage.env)
# The stages that hold a generation engine: their model loads before they reach Kafka, so
# `rollstream run` starts them first, beside the broker's start.
MODEL_STAGES = (Stage.generation, Stage.env)


def pipeline_stages(config: Config) -> tuple[Stage, ...]:
    return AGENTIC_STAGES if isinstance(config, AgenticConfig) else RLVR_STAGES


def run_faust_app(app: faust.App) -> None:
    # The faust Worker owns the event loop and signal handlers (SIGTERM stops it cleanly). Our
    # loggers speak at INFO; faust, mode and the Kafka clients only from WARNING (chatty).
    for name in ("faust", "mode", "aiokafka", "kafka"):
        logging.getLogger(name).setLevel(logging.WARNING)
    faust.Worker(app, loglevel="INFO", quiet=True).execute_from_commandline()


def preflight(config: Config) -> None:
    """Check what the config names but cannot check itself (the trackers' packages, environment
    types, group filter classes and their arguments), before any process or broker starts.
    Raises ConfigError."""
    check_installed(config.trainer.loggers)
    if not isinstance(config, AgenticConfig):
        return
    for env in config.custom_envs.values():
        resolve_env(env.env_type)
    for mode, manager in config.env_managers().items():
        load_group_filter(manager.group_filter_cls, config, manager, mode)


def start_metrics(context: StageContext, port: int = 0):
    """This process's metrics, named after ``context``'s stage: snapshots to ``metrics`` every
    10 s, and ``/metrics`` for Prometheus on ``port`` (0: not served)."""
    metrics = context.metrics
    metrics.start_publishing(lambda: make_producer(context.bootstrap, client_id=f"{metrics.worker}-metrics"),
                             context.topics.metrics)
    metrics.serve(port)
    return metrics


def start_trackers(config: Config, bootstrap: Bootstrap, run_dir: Path) -> Trackers:
    """The trainer process's experiment trackers (``trainer.loggers``; rollstream.observability.trackers),
    started (the run name and resolved config logged) and installed, so each committed step's
    figures reach them (PolicyPublisher.publish_step), with the run summary so far read from the
    topics after each step (rollstream.tools.summary.LiveSummary). None configured, or a rank
    other than 0 under torchrun: trackers that log nothing. They write under ``trainer.log_dir``,
    default ``run_dir``. Close them at the end. Raises ConfigError when a tracker's package is not
    installed."""
    if not config.trainer.loggers or int(os.environ.get("RANK", "0")) > 0:
        return Trackers()
    from rollstream.tools.summary import LiveSummary

    summary = LiveSummary(config, bootstrap, Topics(config.kafka.topic_prefix))
    settings = config.trainer
    trackers = Trackers.of(settings.loggers, settings.project, Path(settings.log_dir or run_dir), summary)
    return trackers.start(config.name, config.model_dump(mode="json")).install()


def _log_to_stderr() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kafka").setLevel(logging.WARNING)  # kafka-python is chatty at INFO


def check_stage(stage: Stage, config: Config) -> None:
    """Raise ConfigError when ``stage`` is not one of the config's pipeline (or the trainer)."""
    if stage is not Stage.trainer and stage not in pipeline_stages(config):
        kind = "agentic" if isinstance(config, AgenticConfig) else "RLVR"
        raise ConfigError(f"stage {stage.value!r} is not part of the {kind} pipeline: "
                          f"{[s.value for s in pipeline_stages(config)] + ['trainer']}")


def load_engine(stage: Stage, config: Config, instance: int = 0, instances: int = 1):
    """The generation engine (a GenerationBackend, rollstream.inference.engine) of a stage in
    MODEL_STAGES, built from ``config.actor_infer`` (rollstream.inference.backends.load_backend);
    None for any other stage.
    Loading it needs no broker: `rollstream worker` does it before waiting for one. Raises
    ConfigError when the stage does not belong to the config's pipeline, or for a bad backend
    configuration."""
    check_stage(stage, config)
    if stage not in MODEL_STAGES:
        return None
    _log_to_stderr()
    from rollstream.inference.backends import load_backend

    started = time.monotonic()
    engine = load_backend(config.actor_infer, config.infer_model_path, instance, instances)
    log.info("%s engine %s loaded in %.1f s", stage.value, config.actor_infer.backend, time.monotonic() - started)
    return engine


def run_stage(stage: Stage, config: Config, bootstrap: Bootstrap, max_idle_s: float | None = None,
              instance: int = 0, instances: int = 1, metrics_port: int = 0, concurrency: int | None = None,
              engine=None) -> None:
    """Run ``stage`` on the cluster ``bootstrap`` (a Cluster carries the client security).
    ``instance``/``instances`` split the input partitions of the plain workers (generation,
    reward, env); the faust stages share theirs through their consumer group. ``concurrency``:
    the reward stage's processes for user reward functions (None: ``reward_concurrency``).
    ``engine``: a MODEL_STAGES stage's engine already loaded (load_engine; None: loaded here);
    closed when the stage ends. Raises ConfigError when the stage does not belong to the
    config's pipeline."""
    _log_to_stderr()
    check_stage(stage, config)
    if stage is Stage.trainer:
        check_installed(config.trainer.loggers)
    context = StageContext.of(config.kafka, bootstrap, stage.value, instance, instances)
    if stage is Stage.trainer and int(os.environ.get("RANK", "0")) > 0:
        metrics_port = 0  # under torchrun the ranks share a host: rank 0 serves /metrics
    if engine is None:
        engine = load_engine(stage, config, instance, instances)
    metrics = start_metrics(context, metrics_port)
    try:
        _run(stage, config, context, max_idle_s, concurrency, engine)
    finally:
        metrics.close()
        if hasattr(engine, "close"):
            engine.close()  # an inference-server backend's HTTP client and loop thread


def _run(stage: Stage, config: Config, context: StageContext, max_idle_s: float | None,
         concurrency: int | None = None, engine=None) -> None:
    bootstrap, topics = context.bootstrap, context.topics
    # Each stage process imports only its own stage module and what that pulls in (model code,
    # environments, reward libraries): ~3 CPU-s for a stage that holds no model (no torch, no
    # transformers), ~20 for one that does, on 2 cores.
    if stage in (Stage.admission, Stage.aggregator, Stage.group_queue):
        create_changelog_topics(bootstrap, config.kafka)
    if stage is Stage.admission:
        from rollstream.streams.admission_agent import build_admission_app

        run_faust_app(build_admission_app(config, context))
    elif stage is Stage.aggregator:
        from rollstream.streams.aggregator_agent import build_aggregator_app

        run_faust_app(build_aggregator_app(config, context))
    elif stage is Stage.generation:
        from rollstream.inference.engine import SamplingParams
        from rollstream.workers.generation import run_generation_worker

        args = config.actor_infer.generating_args
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens)
        run_generation_worker(context, params, backend=engine, group_id=names.consumer_group(topics, "generation"),
                              max_batch=config.actor_infer.max_batch, max_idle_s=max_idle_s, domains=config.rewards,
                              nice=config.actor_infer.nice)
    elif stage is Stage.reward:
        from rollstream.workers.rewards import RewardSpec, run_reward_worker

        specs = {d: RewardSpec(r.reward_type, r.reward_timeout_s, r.reward_batched, r.query_filter_config.metric)
                 for d, r in config.rewards.items()}
        run_reward_worker(context, specs, group_id=names.consumer_group(topics, "reward"), max_idle_s=max_idle_s,
                          concurrency=concurrency or config.reward_concurrency)
    elif stage is Stage.group_queue:
        from rollstream.streams.group_queue_agent import build_group_queue_app

        run_faust_app(build_group_queue_app(config, context))
    elif stage is Stage.env:
        from rollstream.workers.env_worker import run_env_worker

        run_env_worker(context, config, backend=engine, group_id=names.consumer_group(topics, "env"),
                       max_idle_s=max_idle_s, nice=config.actor_infer.nice)
    elif stage is Stage.trainer:
        from rollstream.trainer.driver import run_trainer

        stop = threading.Event()  # SIGTERM stops the trainer between polls
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        run_dir = Path("runs") / config.name
        trackers = start_trackers(config, bootstrap, run_dir)
        try:
            result = run_trainer(config, bootstrap, run_dir, should_stop=stop.is_set)
        finally:
            trackers.close()
        log.info("trainer finished: %s %s (%d batches)", result.outcome, result.detail, result.steps)
