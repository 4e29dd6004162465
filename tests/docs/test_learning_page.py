"""docs/learning.md ("Does it learn") and `make demo-learn`'s config: every key they name is a
real one, with the values they say."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import yaml

from rollstream.config import load_config, parse_config
from rollstream.exceptions import ConfigError
from rollstream.schemas.validation import check_event
from rollstream.data import dataset_prompts
from rollstream.filtering.history import HistoryLimits

ROOT = Path(__file__).resolve().parents[2]


def test_the_history_filter_block_of_the_page_loads_as_documented():
    [block] = re.findall(r"```yaml\n(.*?)```", (ROOT / "docs" / "learning.md").read_text(), re.DOTALL)
    data = yaml.safe_load(block)
    cfg = parse_config({**data, "rollout_batch_size": 2, "num_return_sequences_in_group": 4,
                        "max_prompts_per_batch": 4, "rewards": {"math": {"reward_type": "gsm8k"}}, "datasets": []})
    assert cfg.history_limits() == HistoryLimits(0.125, 0.125, 0.5, 0.05, 0.01, 64, 3, seed=cfg.seed)
    assert cfg.history_limits() == HistoryLimits(seed=cfg.seed)  # the block shows the defaults


def test_demo_learn_validates_every_3_versions_on_prompts_drawn_apart():
    cfg = load_config(ROOT / "examples" / "rlvr_learn.yaml")
    assert (cfg.eval_steps, cfg.num_epochs, cfg.max_steps, cfg.history_filter.enable) == (3, 6, 12, True)
    train, val = (dataset_prompts(d, cfg.seed) for d in cfg.datasets)
    assert (len(train), len(val)) == (16, 16)
    assert {p["mode"] for p in val} == {"val"} and all(p["prompt_id"].startswith("val/") for p in val)
    assert len({p["prompt"] for p in train} & {p["prompt"] for p in val}) < 8  # another seed: mostly other sums
    assert "demo-learn:" in (ROOT / "Makefile").read_text()


def test_the_mixed_workload_holds_the_prompts_the_page_gives():
    cfg = load_config(ROOT / "examples" / "rlvr_mixed.yaml")
    prompts = {(d.mode, d.domain): dataset_prompts(d, cfg.seed) for d in cfg.datasets}
    domains = ("arithmetic", "arithmetic_4digit")
    assert tuple(len(prompts["train", d]) for d in domains) == (12, 36)
    assert tuple(len(prompts["val", d]) for d in domains) == (16, 48)
    assert tuple(cfg.domain_interleave_probs[d] for d in domains) == (0.25, 0.75)
    assert (cfg.num_return_sequences_in_group, cfg.rollout_batch_size, cfg.actor_infer.generating_args.max_new_tokens,
            cfg.max_steps, cfg.eval_steps) == (16, 2, 32, 16, 4)
    assert all(f.query_filter_config.type == "mean_filter" for f in cfg.rewards.values())
    assert (cfg.history_filter.revisit_versions, cfg.history_filter.max_skips, cfg.num_epochs) == (8, 3, 64)
    train = [p["prompt"] for d in domains for p in prompts["train", d]]
    val = [p["prompt"] for d in domains for p in prompts["val", d]]
    assert len(set(train)) == len(train)  # each train sum once
    assert not set(train) & set(val)  # held out: no validation sum is a train sum
    assert len(set(val)) == len(val)  # and each validation sum counts once


def test_the_filtering_benchmark_runs_the_workload_for_its_own_steps(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # the benchmark sets it on import; restored after
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    filtering = importlib.import_module("filtering")
    mixed = ROOT / "examples" / "rlvr_mixed.yaml"
    assert filtering.horizon(None, mixed) == load_config(mixed).max_steps == 16
    assert filtering.horizon(3, mixed) == 3


@pytest.mark.parametrize("overrides, message", [
    ({"history_filter": {"enable": True}}, "history_filter.enable needs num_epochs >= 2"),
    ({"num_epochs": 2, "history_filter": {"enable": True, "explore_init": 0.1, "explore_min": 0.2}},
     "explore_min must be <= explore_init"),
    ({"num_epochs": 2, "history_filter": {"enable": True, "explore_min": 0.0}}, "explore_min"),
    ({"eval_steps": 0}, "eval_steps"),
])
def test_an_absurd_learning_config_is_a_clear_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({"rollout_batch_size": 2, "num_return_sequences_in_group": 4, "max_prompts_per_batch": 4,
                      "rewards": {"math": {"reward_type": "gsm8k"}}, "datasets": [], **overrides})


def test_a_malformed_reward_pattern_is_refused_where_it_enters():
    outcome = {"prompt_id": "p", "domain": "math", "mode": "train", "outcome": "commit", "reason": "accepted",
               "rounds": 1, "responses_generated": 4, "created_ms": 0, "policy_version": 0, "reward_pattern": "some"}
    assert check_event("PromptOutcome", outcome) == \
        "reward_pattern must be one of ['all_correct', 'all_wrong', 'mixed'] or empty, got 'some'"
    assert check_event("PromptOutcome", {**outcome, "reward_pattern": "mixed"}) is None
