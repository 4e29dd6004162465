"""docs/learning.md ("Does it learn") and `make demo-learn`'s config: every key they name is a
real one, with the values they say."""

from __future__ import annotations

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


@pytest.mark.parametrize("name, sizes, interleave, val_sizes", [
    ("rlvr_mixed.yaml", (16, 24), (0.4, 0.6), (8, 12)),
    ("rlvr_sparse.yaml", (16, 96), (0.14, 0.86), (8, 48)),
])
def test_the_mixed_workloads_hold_the_prompts_the_page_gives(name, sizes, interleave, val_sizes):
    """The learnable one-digit sums are the same in both; only the hopeless part and its share change."""
    cfg = load_config(ROOT / "examples" / name)
    prompts = {(d.mode, d.domain): dataset_prompts(d, cfg.seed) for d in cfg.datasets}
    domains = ("arithmetic", "arithmetic_4digit")
    assert tuple(len(prompts["train", d]) for d in domains) == sizes
    assert tuple(len(prompts["val", d]) for d in domains) == val_sizes
    assert tuple(cfg.domain_interleave_probs[d] for d in domains) == interleave
    assert all(f.query_filter_config.type == "mean_filter" for f in cfg.rewards.values())
    mixed = load_config(ROOT / "examples" / "rlvr_mixed.yaml")
    assert [p["prompt"] for p in prompts["train", "arithmetic"]] == \
        [p["prompt"] for p in dataset_prompts(mixed.datasets[0], mixed.seed)]


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
