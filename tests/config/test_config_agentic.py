"""Agentic config validation: the bundled example, the derived values, and every mistake as a
ConfigError naming the field, at start-up (no broker)."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import yaml

from rollstream.kafka.context import StageContext
from rollstream.app.stages import Stage, run_stage
from rollstream.config import AgenticConfig, EnvManagerConfig, RLVRConfig, load_config, parse_config
from rollstream.exceptions import ConfigError
from rollstream.kafka.topics import Topics
from rollstream.workers.env_worker import run_env_worker
from rollstream.workers.envs import resolve_env

# the hint of a module that is not found (rollstream.registry.import_object)
LOOKED_UP = f" (looked up beside the config file, in the working directory {os.getcwd()} and in the installed packages)"

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "agentic_frozenlake.yaml"
UNREACHABLE = "127.0.0.1:1"  # nothing listens here: a test that reaches Kafka would hang or fail


def example_data() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


def parse_modified(mutate) -> AgenticConfig:
    data = copy.deepcopy(example_data())
    mutate(data)
    return parse_config(data)


def manager(**overrides) -> EnvManagerConfig:
    fields = {"num_env_groups": 5, "group_size": 4, "tags": ["A", "B"]}
    fields.update(overrides)
    return EnvManagerConfig(**fields)


# -- the bundled example -----------------------------------------------------------------------

def test_bundled_agentic_example_loads_as_agentic_config():
    cfg = load_config(EXAMPLE)
    assert isinstance(cfg, AgenticConfig) and not isinstance(cfg, RLVRConfig)
    train = cfg.train_env_manager
    assert (cfg.name, cfg.seed, cfg.rollout_batch_size, cfg.max_steps, cfg.min_fill_ratio) == ("demo-agentic", 42, 8, 1, 0.5)
    assert cfg.groups_per_batch == 2
    assert (train.num_env_groups, train.group_size, train.group_size_redundancy) == (3, 4, 1)
    assert train.runs_per_episode == 5
    assert train.num_groups_partition == [2, 1]
    assert [train.tag_of(g) for g in range(3)] == ["FrozenLake", "FrozenLake", "GymFrozenLake"]
    assert train.group_filter_cls == "env_failure_std"
    assert train.group_filter_config == {"std_threshold": 0.0}
    assert (train.max_replaced_episodes, train.episode_timeout_s, train.max_reissues_per_episode) == (4, 300.0, 1)
    assert (train.refill.enabled, train.refill.max_refills_per_group, train.refill.min_valid_group_size) == (True, 2, None)
    val = cfg.val_env_manager
    assert val is not None
    assert (val.num_env_groups, val.group_size, val.tags) == (1, 2, ["FrozenLake"])
    assert val.group_filter_cls == "default"  # never drops
    assert val.tag_of(0) == "FrozenLake"
    assert list(cfg.env_managers()) == ["train", "val"]
    assert sorted(cfg.custom_envs) == ["FrozenLake", "GymFrozenLake"]
    lake, gym_lake = cfg.custom_envs["FrozenLake"], cfg.custom_envs["GymFrozenLake"]
    assert (lake.env_type, lake.max_actions_per_traj, lake.max_tokens_per_step, lake.format_penalty) == (
        "frozen_lake_textarena", 3, 16, -0.1)
    assert (gym_lake.env_type, gym_lake.env_config) == ("frozen_lake", {"is_slippery": False})
    assert cfg.kafka.bootstrap_servers is None and cfg.kafka.partitions == 2


def test_train_env_manager_key_selects_the_agentic_model():
    data = example_data()
    assert isinstance(parse_config(data), AgenticConfig)
    del data["train_env_manager"]
    with pytest.raises(ConfigError) as info:  # without it the mapping is read as an RLVR config
        parse_config(data)
    message = str(info.value)
    assert "num_return_sequences_in_group: Field required" in message
    assert "custom_envs: Extra inputs are not permitted" in message


# -- derived values ----------------------------------------------------------------------------

def test_group_seed_is_deterministic_and_differs_by_mode_and_group():
    cfg = load_config(EXAMPLE)
    again = load_config(EXAMPLE)
    # pinned: every run of every process must play the same episodes for the same config
    assert [cfg.group_seed("train", g) for g in range(3)] == [385686, 561079, 234035]
    assert cfg.group_seed("val", 0) == 125611
    assert [again.group_seed("train", g) for g in range(3)] == [cfg.group_seed("train", g) for g in range(3)]
    seeds = {cfg.group_seed(mode, g) for mode in ("train", "val") for g in range(50)}
    assert len(seeds) == 100  # no two (mode, group_id) share a seed here
    assert all(0 <= s < 1_000_000 for s in seeds)
    other = parse_modified(lambda d: d.update(seed=43))
    assert other.group_seed("train", 0) != cfg.group_seed("train", 0)


def test_episodes_per_group_counts_steps_for_train_only():
    cfg = load_config(EXAMPLE)
    assert (cfg.episodes_per_group("train"), cfg.episodes_per_group("val")) == (1, 1)

    def bigger(d):
        d["max_steps"] = 3
        d["train_env_manager"]["max_traj_per_env"] = 2
        d["val_env_manager"]["max_traj_per_env"] = 4

    cfg = parse_modified(bigger)
    assert cfg.episodes_per_group("train") == 6  # max_traj_per_env x max_steps
    assert cfg.episodes_per_group("val") == 4  # validation runs once
    no_val = parse_modified(lambda d: d.pop("val_env_manager"))
    assert list(no_val.env_managers()) == ["train"]
    with pytest.raises(KeyError, match="val"):
        no_val.episodes_per_group("val")
    zero_val = parse_modified(lambda d: d["val_env_manager"].update(num_env_groups=0))
    assert list(zero_val.env_managers()) == ["train"]  # a val manager without groups is off


def test_tag_of_default_partition_and_out_of_range():
    m = manager()  # 5 groups over 2 tags: as even as possible, the first tag takes the extra one
    assert [m.tag_of(g) for g in range(5)] == ["A", "A", "A", "B", "B"]
    skewed = manager(num_groups_partition=[1, 4])
    assert [skewed.tag_of(g) for g in range(5)] == ["A", "B", "B", "B", "B"]
    for bad in (5, 6, -1):
        with pytest.raises(ValueError, match=r"out of range \[0, 5\)"):
            m.tag_of(bad)
    with pytest.raises(ValueError, match=r"group_id -1 out of range"):
        skewed.tag_of(-1)


# -- validation errors: field path and reason ----------------------------------------------------

def set_in(*path_and_value):
    *path, key, value = path_and_value

    def mutate(d):
        for p in path:
            d = d[p]
        d[key] = value
    return mutate


@pytest.mark.parametrize("mutate, expected", [
    (set_in("rollout_batch_size", 6),
     "rollout_batch_size 6 is not a multiple of train_env_manager.group_size 4"),
    (set_in("train_env_manager", "tags", ["FrozenLake", "Sokoban"]),
     "train_env_manager.tags ['Sokoban'] have no custom_envs entry; "
     "known: ['FrozenLake', 'GymFrozenLake']"),
    (set_in("val_env_manager", "tags", ["Maze"]),
     "val_env_manager.tags ['Maze'] have no custom_envs entry; "
     "known: ['FrozenLake', 'GymFrozenLake']"),
    (set_in("train_env_manager", "num_groups_partition", [3]),
     "train_env_manager: num_groups_partition needs one count per tag"),
    (set_in("train_env_manager", "num_groups_partition", [2, 2]),
     "train_env_manager: num_groups_partition must sum to num_env_groups"),
    (set_in("val_env_manager", "num_groups_partition", [2]),
     "val_env_manager: num_groups_partition must sum to num_env_groups"),
    (set_in("train_env_manager", "refill", {"min_valid_group_size": 5}),
     "train_env_manager: refill.min_valid_group_size 5 > group_size 4"),
    (set_in("train_env_manager", "group_filter_cls", "EnvFailureStd"),
     "train_env_manager.group_filter_cls: unknown group_filter_cls 'EnvFailureStd'; valid: ['default', 'drop_flag', "
     "'env_failure_std'] or an import path 'pkg.module:name'"),
    (set_in("train_env_manager", "group_size_redundancy", -1),
     "train_env_manager.group_size_redundancy: Input should be greater than or equal to 0"),
    (set_in("custom_envs", "FrozenLake", "format_penalty", 0.5),
     "custom_envs.FrozenLake.format_penalty: Input should be less than or equal to 0"),
    (lambda d: (d["train_env_manager"].update(num_env_groups=0), d["train_env_manager"].pop("num_groups_partition")),
     "train_env_manager.num_env_groups must be >= 1: no group could ever fill a batch"),
    (set_in("surprise_key", 1), "surprise_key: Extra inputs are not permitted"),
    (set_in("train_env_manager", "surprise_key", 1), "train_env_manager.surprise_key: Extra inputs are not permitted"),
    (set_in("custom_envs", "GymFrozenLake", "max_turns", 3),
     "custom_envs.GymFrozenLake.max_turns: Extra inputs are not permitted"),
], ids=["batch-not-multiple", "train-tag-unknown", "val-tag-unknown", "partition-length", "partition-sum",
        "val-partition-sum", "min-valid-above-group-size", "filter-cls-unknown", "negative-redundancy",
        "positive-format-penalty", "no-train-groups", "unknown-top-key", "unknown-manager-key", "unknown-env-key"])
def test_invalid_agentic_config_names_field_and_reason(mutate, expected):
    with pytest.raises(ConfigError) as info:
        parse_modified(mutate)
    assert str(info.value) == "invalid config: " + expected


def test_several_mistakes_are_reported_together():
    def two(d):
        d["train_env_manager"]["group_size_redundancy"] = -1
        d["custom_envs"]["FrozenLake"]["format_penalty"] = 0.5
    with pytest.raises(ConfigError) as info:
        parse_modified(two)
    lines = str(info.value).splitlines()
    assert lines[0] == "invalid config:"
    assert sorted(line.strip() for line in lines[1:]) == [
        "custom_envs.FrozenLake.format_penalty: Input should be less than or equal to 0",
        "train_env_manager.group_size_redundancy: Input should be greater than or equal to 0",
    ]


def test_format_penalty_zero_is_allowed():
    cfg = parse_modified(set_in("custom_envs", "FrozenLake", "format_penalty", 0.0))
    assert cfg.custom_envs["FrozenLake"].format_penalty == 0.0


# -- unknown env_type: accepted by the config, refused when the env worker starts ----------------

@pytest.mark.parametrize("old, new", [("gym:FrozenLake-v1", "frozen_lake"), ("textarena:Sokoban-v0", "sokoban")])
def test_an_old_env_spelling_is_refused_at_load_naming_the_new_one(old, new):
    with pytest.raises(ConfigError) as info:
        parse_modified(set_in("custom_envs", "GymFrozenLake", "env_type", old))
    assert f"env_type '{old}' is now spelled '{new}'" in str(info.value)
    assert "\n" not in str(info.value).split("custom_envs.GymFrozenLake.env_type: ")[-1]


def test_unknown_env_type_is_refused_at_env_worker_start_not_by_the_config():
    cfg = parse_modified(set_in("custom_envs", "GymFrozenLake", "env_type", "nope:x"))
    assert cfg.custom_envs["GymFrozenLake"].env_type == "nope:x"  # the config cannot import-check it
    expected = f"cannot import env_type 'nope:x': module 'nope': ModuleNotFoundError: No module named 'nope'{LOOKED_UP}"
    with pytest.raises(ConfigError) as info:
        resolve_env("nope:x")
    assert str(info.value) == expected
    # the worker resolves every custom_envs entry before it builds a model or touches Kafka
    with pytest.raises(ConfigError) as info:
        run_env_worker(StageContext(UNREACHABLE, Topics("never."), "env"), cfg)
    assert str(info.value) == expected
    with pytest.raises(ConfigError) as info:
        run_stage(Stage.env, cfg, UNREACHABLE)
    assert str(info.value) == expected


@pytest.mark.parametrize("mutate, expected", [
    (set_in("custom_envs", "GymFrozenLake", "env_type", "nope:x"), "cannot import env_type 'nope:x'"),
    (set_in("train_env_manager", "group_filter_cls", "nosuch.module:Filter"), "nosuch.module:Filter"),
    (set_in("train_env_manager", "group_filter_config", {"std_threshold": "abc"}),
     "group_filter_config.std_threshold must be a number, got 'abc'"),
])
def test_run_refuses_what_the_config_cannot_check_before_starting_a_broker(tmp_path, mutate, expected):
    """`rollstream run` checks env types and group filters first: a clear error, no broker, no
    stage processes (the run directory is never created)."""
    from rollstream.app.run import run_pipeline

    cfg = parse_modified(mutate)
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        run_pipeline(cfg, run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


# -- the group filter contract in the help text ---------------------------------------------------

def test_group_filter_cls_help_says_true_means_drop():
    help_text = EnvManagerConfig.model_fields["group_filter_cls"].description
    assert "returns True to DROP the group" in help_text
    assert "False to keep it" in help_text
    assert "Return false to filter out" not in help_text  # the reference's wrong wording
