"""A stage's context, built once per process from its config."""

from __future__ import annotations

import os

import pytest

from rollstream.config import parse_config
from rollstream.kafka.context import StageContext

CONFIG = {"rollout_batch_size": 1, "max_prompts_per_batch": 2, "num_return_sequences_in_group": 2, "rewards": {"math": {"reward_type": "gsm8k"}},
          "datasets": [], "kafka": {"topic_prefix": "ctx.", "max_message_bytes": 2 * 1024 * 1024,
                                    "compression_type": "zstd"}}


def test_the_context_carries_the_runs_topics_and_kafka_settings():
    context = StageContext.of(parse_config(CONFIG).kafka, "localhost:9", "reward", 1, 3)
    assert (context.topics.responses, context.max_message_bytes, context.compression_type) == (
        "ctx.responses", 2 * 1024 * 1024, "zstd")
    assert (context.instance, context.instances, context.stage) == (1, 3, "reward")
    assert context.worker.startswith("reward-") and context.worker.endswith(f"-{os.getpid()}")


def test_an_instance_outside_the_range_is_refused():
    with pytest.raises(ValueError, match=r"instance must be in \[0, 2\), got 2"):
        StageContext.of(parse_config(CONFIG).kafka, "localhost:9", "x", instance=2, instances=2)
