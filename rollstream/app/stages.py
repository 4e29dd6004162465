"""Start one pipeline stage in this process: what `rollstream worker <stage>` runs."""

from __future__ import annotations

import logging
from enum import Enum
from pathlib import Path

from rollstream.config import AgenticConfig, Config
from rollstream.exceptions import ConfigError
from rollstream.kafka.topics import Topics


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


def pipeline_stages(config: Config) -> tuple[Stage, ...]:
    return AGENTIC_STAGES if isinstance(config, AgenticConfig) else RLVR_STAGES


def run_faust_app(app) -> None:
    import faust

    # The faust Worker owns the event loop and signal handlers (SIGTERM stops it cleanly). Our
    # loggers speak at INFO; faust, mode and the Kafka clients only from WARNING (chatty).
    for name in ("faust", "mode", "aiokafka", "kafka"):
        logging.getLogger(name).setLevel(logging.WARNING)
    faust.Worker(app, loglevel="INFO", quiet=True).execute_from_commandline()


def preflight(config: Config) -> None:
    """Check what the config names but cannot check itself (environment types, group filter
    classes and their arguments), before any process or broker starts. Raises ConfigError."""
    if not isinstance(config, AgenticConfig):
        return
    from rollstream.filtering.group_filters import load_group_filter
    from rollstream.workers.envs import resolve_env

    for env in config.custom_envs.values():
        resolve_env(env.env_type)
    for mode, manager in config.env_managers().items():
        load_group_filter(manager.group_filter_cls, config, manager, mode)


def backend_kwargs(actor_infer) -> dict:
    """Constructor arguments of the configured generation backend beyond its defaults."""
    if actor_infer.backend == "transformers":
        import torch

        return {"dtype": getattr(torch, actor_infer.dtype)}
    return {"dtype": actor_infer.dtype}  # vllm.LLM takes the name


def start_metrics(stage: str, bootstrap: str, topics: Topics, port: int = 0):
    """This process's metrics, named after ``stage``: snapshots to ``metrics`` every 10 s, and
    ``/metrics`` for Prometheus on ``port`` (0: not served)."""
    from rollstream.observability.metrics import process_metrics
    from rollstream.runtime import worker_id

    metrics = process_metrics(worker_id(stage))
    metrics.start_publishing(bootstrap, topics)
    metrics.serve(port)
    return metrics


def run_stage(stage: Stage, config: Config, bootstrap: str, max_idle_s: float | None = None,
              instance: int = 0, instances: int = 1, metrics_port: int = 0) -> None:
    """``instance``/``instances`` split the input partitions of the plain workers (generation,
    reward, env); the faust stages share theirs through their consumer group. Raises ConfigError
    when the stage does not belong to the config's pipeline."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kafka").setLevel(logging.WARNING)  # kafka-python is chatty at INFO
    if stage is not Stage.trainer and stage not in pipeline_stages(config):
        kind = "agentic" if isinstance(config, AgenticConfig) else "RLVR"
        raise ConfigError(f"stage {stage.value!r} is not part of the {kind} pipeline: "
                          f"{[s.value for s in pipeline_stages(config)] + ['trainer']}")
    topics = Topics(config.kafka.topic_prefix)
    metrics = start_metrics(stage.value, bootstrap, topics, metrics_port)
    try:
        _run(stage, config, bootstrap, topics, max_idle_s, instance, instances)
    finally:
        metrics.close()


def _run(stage: Stage, config: Config, bootstrap: str, topics: Topics, max_idle_s: float | None,
         instance: int, instances: int) -> None:
    if stage in (Stage.admission, Stage.aggregator, Stage.group_queue):
        from rollstream.kafka.admin import create_topics
        from rollstream.kafka.names import changelog_topics

        create_topics(bootstrap, changelog_topics(topics, config.kafka.partitions))
    if stage is Stage.admission:
        from rollstream.streams.admission import build_admission_app

        run_faust_app(build_admission_app(config, bootstrap))
    elif stage is Stage.aggregator:
        from rollstream.streams.aggregator import build_aggregator_app

        run_faust_app(build_aggregator_app(config, bootstrap))
    elif stage is Stage.generation:
        from rollstream.workers.generation import SamplingParams, run_generation_worker

        args = config.actor_infer.generating_args
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens)
        run_generation_worker(bootstrap, topics, params, backend=config.actor_infer.backend,
                              group_id=f"{topics.prefix}generation", max_batch=config.actor_infer.max_batch,
                              max_idle_s=max_idle_s, instance=instance, instances=instances,
                              backend_kwargs=backend_kwargs(config.actor_infer))
    elif stage is Stage.reward:
        from rollstream.workers.rewards import run_reward_worker

        run_reward_worker(bootstrap, topics, {d: r.reward_type for d, r in config.rewards.items()},
                          group_id=f"{topics.prefix}reward", max_idle_s=max_idle_s,
                          instance=instance, instances=instances)
    elif stage is Stage.group_queue:
        from rollstream.streams.group_queue import build_group_queue_app

        run_faust_app(build_group_queue_app(config, bootstrap))
    elif stage is Stage.env:
        from rollstream.workers.env_worker import run_env_worker

        run_env_worker(bootstrap, topics, config, group_id=f"{topics.prefix}env", max_idle_s=max_idle_s,
                       instance=instance, instances=instances, backend_kwargs=backend_kwargs(config.actor_infer))
    elif stage is Stage.trainer:
        run_trainer(config, bootstrap)


def policy_trainer(config: Config, checkpoint_dir: Path):
    """The PolicyTrainer of ``config`` (loads the model; resumes from the newest checkpoint in
    ``checkpoint_dir``), or None when ``actor_train.enabled`` is off."""
    if not config.actor_train.enabled:
        return None
    from rollstream.trainer.checkpoint import CheckpointStore
    from rollstream.trainer.policy import PolicyTrainer

    return PolicyTrainer(config.actor_train.settings(), config.train_infer_correction,
                         checkpoints=CheckpointStore(checkpoint_dir, config.actor_train.keep_checkpoints))


def start_training(config: Config, bootstrap: str, builder, run_dir: Path):
    """The trainer side of a run: returns ``(trainer, publisher)``.

    The PolicyTrainer (None with training off) resumes from ``run_dir/checkpoints``; a batch a
    crash left trained but uncommitted is recorded in the builder (BatchBuilder.recover); the
    current policy version is published, so workers and the admission start from it.
    """
    from rollstream.policy.versions import PolicyPublisher

    trainer = policy_trainer(config, run_dir / "checkpoints")
    if trainer is not None and trainer.resumed is not None:
        builder.recover(trainer.resumed)
    publisher = PolicyPublisher(bootstrap, Topics(config.kafka.topic_prefix))
    if trainer is not None:
        publisher.publish(trainer.policy_version, builder.step - 1, trainer.checkpoint, trainer.policy_version > 0)
    else:
        publisher.publish(builder.step, builder.step - 1, "", False)
    return trainer, publisher


def groups_per_batch(config: Config) -> int:
    """Groups in one trainer batch: RLVR counts prompts, the agentic rollout_batch_size trajectories."""
    return config.groups_per_batch if isinstance(config, AgenticConfig) else config.rollout_batch_size


def run_trainer(config: Config, bootstrap: str) -> None:
    """Build batches until max_steps (or an underfilled verdict); SIGTERM stops it between polls."""
    import signal
    import threading

    from rollstream.trainer.consumer import BatchBuilder
    from rollstream.trainer.loop import AgenticBatchEvents, BatchEvents, build_batches

    topics = Topics(config.kafka.topic_prefix)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    run_dir = Path("runs") / config.name
    builder = BatchBuilder(bootstrap, topics, groups_per_batch(config), group_id=f"{topics.prefix}trainer",
                           manifest_path=run_dir / "batches.jsonl", max_staleness=config.max_staleness)
    events = (AgenticBatchEvents(bootstrap, topics, config, builder) if isinstance(config, AgenticConfig)
              else BatchEvents(bootstrap, topics))
    publisher = None
    try:
        trainer, publisher = start_training(config, bootstrap, builder, run_dir)
        result = build_batches(builder, events, max_steps=config.max_steps, min_fill_ratio=config.min_fill_ratio,
                               should_stop=stop.is_set, train=trainer.train if trainer is not None else None,
                               publish=publisher.publish_batch)
    finally:
        events.close()
        builder.close()
        if publisher is not None:
            publisher.close()
    logging.getLogger(__name__).info("trainer finished: %s %s (%d batches)", result.outcome, result.detail, len(result.batches))
