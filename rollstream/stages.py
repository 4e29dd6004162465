"""Start one pipeline stage in this process: what `rollstream worker <stage>` runs."""

from __future__ import annotations

import logging
from enum import Enum

from rollstream.config import RLVRConfig
from rollstream.topics import Topics


class Stage(str, Enum):
    admission = "admission"
    aggregator = "aggregator"
    generation = "generation"
    reward = "reward"


def run_faust_app(app) -> None:
    import faust

    # The faust Worker owns the event loop and signal handlers (SIGTERM stops it cleanly).
    faust.Worker(app, loglevel="WARNING", quiet=True).execute_from_commandline()


def run_stage(stage: Stage, config: RLVRConfig, bootstrap: str, max_idle_s: float | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    topics = Topics(config.kafka.topic_prefix)
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
                              max_idle_s=max_idle_s)
    elif stage is Stage.reward:
        from rollstream.workers.rewards import run_reward_worker

        run_reward_worker(bootstrap, topics, {d: r.reward_type for d, r in config.rewards.items()},
                          group_id=f"{topics.prefix}reward", max_idle_s=max_idle_s)
