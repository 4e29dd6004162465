"""Config overrides (``key.sub=value``): applied to the file's mapping before validation, typed as
YAML, refused in one line naming the override."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollstream.config import load_config
from rollstream.config.overrides import apply_overrides, parse_override
from rollstream.exceptions import ConfigError

ROOT = Path(__file__).resolve().parents[2]
RLVR = ROOT / "examples" / "rlvr_math.yaml"
AGENTIC = ROOT / "examples" / "agentic_frozenlake.yaml"


@pytest.mark.parametrize(("text", "path", "value"), [
    ("max_steps=4", ["max_steps"], 4),
    ("actor_train.lr=2.0e-6", ["actor_train", "lr"], 2e-6),
    ("kafka.bootstrap_servers=null", ["kafka", "bootstrap_servers"], None),
    ("actor_train.enabled=false", ["actor_train", "enabled"], False),
    ("train_env_manager.tags=[FrozenLake, GymFrozenLake]", ["train_env_manager", "tags"], ["FrozenLake", "GymFrozenLake"]),
    ("name=my run=2", ["name"], "my run=2"),  # the first = splits
    ("name=", ["name"], ""),
])
def test_an_override_is_a_dotted_key_and_a_yaml_value(text, path, value):
    assert parse_override(text) == (path, value)


def test_overrides_apply_left_to_right_into_a_copy_creating_sections_and_indexing_lists():
    data = {"max_steps": 2, "datasets": [{"source": "a"}, {"source": "b"}], "kafka": None}
    out = apply_overrides(data, ["max_steps=3", "max_steps=5", "datasets.1.num_samples=7", "kafka.partitions=4",
                                 "actor_train.lr=1.0e-5"])
    assert out == {"max_steps": 5, "datasets": [{"source": "a"}, {"source": "b", "num_samples": 7}],
                   "kafka": {"partitions": 4}, "actor_train": {"lr": 1e-5}}
    assert data == {"max_steps": 2, "datasets": [{"source": "a"}, {"source": "b"}], "kafka": None}


def test_a_loaded_config_carries_the_overrides_and_keeps_the_rest_of_the_file():
    plain = load_config(RLVR)
    cfg = load_config(RLVR, ["max_steps=7", "rewards.gsm8k.query_filter_config.filter_args.std_threshold=0.25",
                             "kafka.partitions=3"])
    assert (cfg.max_steps, cfg.kafka.partitions) == (7, 3)
    assert cfg.rewards["gsm8k"].query_filter_config.filter_args["std_threshold"] == 0.25
    assert cfg.model_dump(exclude={"max_steps", "rewards", "kafka"}) == plain.model_dump(
        exclude={"max_steps", "rewards", "kafka"})
    agentic = load_config(AGENTIC, ["train_env_manager.group_size=2", "train_env_manager.group_size_redundancy=0"])
    assert (agentic.train_env_manager.group_size, agentic.train_env_manager.group_size_redundancy) == (2, 0)


@pytest.mark.parametrize(("override", "message"), [
    ("max_steps=abc", "override max_steps=abc: max_steps: Input should be a valid integer"),
    ("bogus=1", "override bogus=1: bogus: Extra inputs are not permitted"),
    ("actor_train.bogus.deeper=1", "override actor_train.bogus.deeper=1: actor_train.bogus: Extra inputs are not permitted"),
    ("seed.x=1", "override seed.x=1: seed is int 42, not a mapping"),
    ("datasets.9.source=x", "override datasets.9.source=x: datasets is a list of 3; '9' is not an index of it"),
    ("datasets.first.source=x", "override datasets.first.source=x: datasets is a list of 3; 'first' is not an index"),
    ("max_steps", "override 'max_steps': expected KEY=VALUE"),
    ("a..b=1", "override 'a..b=1': expected KEY=VALUE"),
    ("max_steps=[1", "override max_steps=[1: the value is not valid YAML"),
])
def test_a_bad_override_is_one_line_naming_it(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(RLVR, ["max_steps=3", override])
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_a_problem_of_the_file_itself_is_reported_as_without_overrides(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(RLVR.read_text().replace("type: std_filter", "type: median_filter"))
    with pytest.raises(ConfigError, match=r"^invalid config: rewards\.gsm8k"):
        load_config(bad, ["max_steps=3"])
