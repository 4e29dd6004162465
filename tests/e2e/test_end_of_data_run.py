"""`rollstream run` when the prompts run out before the batches are full: two epochs over three
prompts with the real model (SmolLM2-135M on CPU, no training), more resampling budget than
prompts. The run ends at once on admission's end-of-data verdict, with the rest as a final
partial batch marked ``end_of_data``."""

from __future__ import annotations

import uuid

import pytest

from rollstream.app.run import run_pipeline
from rollstream.config import parse_config
from rollstream.kafka.topics import Topics
from rollstream.tools.readback import read_values

pytestmark = [pytest.mark.e2e, pytest.mark.integration]


def test_run_ends_with_a_partial_batch_marked_end_of_data(kafka_broker, tmp_path):
    prefix = f"e2e-{uuid.uuid4().hex[:8]}."
    config = parse_config({
        "name": "e2e-end",
        "kafka": {"bootstrap_servers": kafka_broker, "topic_prefix": prefix, "partitions": 2},
        "rollout_batch_size": 4,
        "num_return_sequences_in_group": 2,
        "max_running_prompts": 4,
        "max_prompts_per_batch": 32,
        "min_fill_ratio": 0.5,
        "max_steps": 5,
        "num_epochs": 2,
        "time_limit_s": 600,
        "actor_infer": {"max_batch": 4, "generating_args": {"temperature": 1.0, "max_new_tokens": 4}},
        "actor_train": {"enabled": False},
        "rewards": {
            "arithmetic": {"reward_type": "reasoning_gym", "query_filter_config": {"type": "no_filter"},
                           "response_filter_config": {"type": "default", "filter_args": {"reject_truncated": False}}},
        },
        "datasets": [
            {"source": "reasoning-gym/basic_arithmetic", "domain": "arithmetic", "num_samples": 3,
             "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}},
        ],
    })
    summary = run_pipeline(config, run_dir=tmp_path / "run")

    assert summary["outcome"] == "end_of_data", summary
    assert summary["detail"] == "step 1: 2/4 groups after 2 prompts (min_fill_ratio 0.5); rejected: {}"
    assert [(b["step"], b["status"], b["groups"], b.get("end_of_data")) for b in summary["batches"]] == [
        (0, "complete", 4, None), (1, "partial", 2, True)]
    assert summary["groups_accepted"] == 6 and summary["prompts_admitted"] == 6
    ids = sorted(g["prompt_id"] for g in read_values(kafka_broker, Topics(prefix).groups_accepted))
    assert [pid for pid in ids if pid.endswith("#e1")] == [f"{pid}#e1" for pid in ids if "#" not in pid]
