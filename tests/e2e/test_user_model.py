"""End to end with a user's own model: a tiny random-weights Qwen2 (tests/tiny_models.py), named by
`pretrain` in a YAML config, generates and trains through `rollstream run` on the real broker."""

from __future__ import annotations

import json
import math
import uuid

import pytest
import yaml

from rollstream.app.run import run_pipeline
from rollstream.config import load_config
from rollstream.kafka.payloads import PayloadFetcher, ref_key
from rollstream.kafka.topics import Topics
from rollstream.policy.model import chat_prompt_ids, load_tokenizer
from rollstream.schemas import decode
from rollstream.tools.readback import read_values
from tests.tiny_models import TINY_EOS_ID, build_tiny_qwen2

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

MAX_NEW_TOKENS = 6


def own_config(kafka_broker: str, model_dir, prefix: str, **rewards) -> dict:
    """The tiny model's run: 1 step of 1 group of 2 responses on 1-digit sums; ``rewards``
    overrides the arithmetic domain's keys."""
    return {
        "name": "e2e-own-model",
        "pretrain": str(model_dir),
        "kafka": {"bootstrap_servers": kafka_broker, "topic_prefix": prefix, "partitions": 1},
        "rollout_batch_size": 1,
        "num_return_sequences_in_group": 2,
        "max_running_prompts": 1,
        "max_prompts_per_batch": 3,
        "max_steps": 1,
        "time_limit_s": 300,
        "actor_infer": {"device": "cpu", "max_batch": 2,
                        "generating_args": {"temperature": 1.0, "max_new_tokens": MAX_NEW_TOKENS}},
        "actor_train": {"device": "cpu", "lr": 1e-5, "micro_batch_size": 2},
        "rewards": {"arithmetic": {"reward_type": "reasoning_gym", "query_filter_config": {"type": "no_filter"},
                                   "response_filter_config": {"type": "default",
                                                              "filter_args": {"reject_truncated": False}},
                                   **rewards}},
        "datasets": [{"source": "reasoning-gym/basic_arithmetic", "domain": "arithmetic", "num_samples": 2,
                      "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}],
    }


def test_own_qwen2_model_generates_and_trains(kafka_broker, tmp_path):
    model_dir = build_tiny_qwen2(tmp_path / "my-qwen2")
    prefix = f"e2e-own-{uuid.uuid4().hex[:8]}."
    config_path = tmp_path / "own_model.yaml"
    config_path.write_text(yaml.safe_dump(own_config(kafka_broker, model_dir, prefix)))
    config = load_config(config_path)
    assert config.infer_model_path == config.train_model_path == str(model_dir)

    run_dir = tmp_path / "run"
    summary = run_pipeline(config, run_dir=run_dir)

    assert summary["outcome"] == "complete", summary
    assert len(summary["batches"]) == 1
    batch = summary["batches"][0]
    assert (batch["groups"], batch["responses_per_group"]) == (1, [2])
    assert (batch["skipped"], batch["policy_version"], batch["generator_versions"]) == (False, 1, [0])
    assert math.isfinite(batch["loss"]) and math.isfinite(batch["grad_norm"])
    assert summary["policy_versions_published"] == [0, 1]
    # the trained policy version is the user's architecture, with its own tokenizer
    checkpoint = run_dir / "checkpoints" / "v000001"
    saved = json.loads((checkpoint / "config.json").read_text())
    assert (saved["architectures"], saved["model_type"], saved["num_hidden_layers"]) == (["Qwen2ForCausalLM"], "qwen2", 2)
    assert json.loads((checkpoint / "tokenizer_config.json").read_text())["eos_token"] == "<|endoftext|>"

    # the Responses: prompts templated by the model's tokenizer, tokens from its vocabulary,
    # stopping on its eos (id 0; the bundled model's would be <|im_end|>, id 2)
    tokenizer = load_tokenizer(model_dir)
    vocab = saved["vocab_size"]
    groups = read_values(kafka_broker, Topics(prefix).groups_accepted)
    rows = [rewarded for group in groups for rewarded in group["responses"]]
    assert len(rows) >= 2
    with PayloadFetcher(kafka_broker) as fetcher:
        fetched = fetcher.fetch([rewarded["payload"] for rewarded in rows])
    responses = []
    for rewarded in rows:
        schema, response = decode(fetched.values[ref_key(rewarded["payload"])])
        assert schema == "Response" and response["policy_version"] == 0
        responses.append(response)
        assert list(response["prompt_token_ids"]) == chat_prompt_ids(tokenizer, response["prompt"])
        tokens = list(response["response_token_ids"])
        assert 1 <= len(tokens) <= MAX_NEW_TOKENS and all(0 <= t < vocab for t in tokens)
        assert TINY_EOS_ID not in tokens[:-1]
        assert response["finish_reason"] == ("stop" if tokens[-1] == TINY_EOS_ID else "length")
        assert len(response["infer_logprobs"]) == len(tokens)
        assert all(math.isfinite(lp) and lp <= 0.0 for lp in response["infer_logprobs"].tolist())
    # eos has p = 0.5 per step: P(no stop in 2 responses of 6 tokens) = 1/4096
    assert any(r["finish_reason"] == "stop" for r in responses)


def test_a_metric_the_reward_function_does_not_return_ends_the_run_at_once_naming_it(kafka_broker, tmp_path):
    """A user function that returns ``acc`` under a config whose query filter reads
    ``accuracy``: the reward stage names both at its first scored response and the run ends
    ``config_error`` (before: every group rejected invalid_reward, outcome batch_underfilled)."""
    model_dir = build_tiny_qwen2(tmp_path / "my-qwen2")
    prefix = f"e2e-metric-{uuid.uuid4().hex[:8]}."
    config_path = tmp_path / "typo.yaml"
    config_path.write_text(yaml.safe_dump(own_config(
        kafka_broker, model_dir, prefix, reward_type="tests.workers.user_rewards:exact_match",
        query_filter_config={"type": "std_filter", "metric": "accuracy"})))
    summary = run_pipeline(load_config(config_path), run_dir=tmp_path / "run")
    assert summary["outcome"] == "config_error", summary
    assert summary["detail"] == (
        "stage reward: rewards.arithmetic.query_filter_config.metric 'accuracy' is not among the scores "
        "tests.workers.user_rewards:exact_match returned: ['acc', 'sample_index', 'score']; name one of them "
        "(or 'response_level_reward') or return 'accuracy' in the function's dict"), summary["detail"]
    assert summary["stage_restarts"] == {} and summary["batches"] == []
