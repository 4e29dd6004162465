"""Agentic group filters: True means DROP (the reference's code, not its help text)."""

from __future__ import annotations

import json
import math

import pytest

from rollstream.config import EnvManagerConfig
from rollstream.exceptions import ConfigError
from rollstream.filtering import (
    DropFlagGroupFilter,
    EnvFailureStdGroupFilter,
    GroupFilter,
    UnknownFilterError,
    filter_group,
    load_group_filter,
)
from rollstream.schemas import decode, encode
from rollstream.schemas.records import payload_ref

ENV_FAILURE_STD = "rollstream.filtering.group_filters:EnvFailureStdGroupFilter"
DROP_FLAG = "rollstream.filtering.group_filters:DropFlagGroupFilter"


def manager(group_size: int = 4, **group_filter_config) -> EnvManagerConfig:
    return EnvManagerConfig(num_env_groups=2, group_size=group_size, tags=["frozen_lake"],
                            group_filter_config=group_filter_config)


def traj(reward: float, *, env_timeout: bool = False, env_failed: bool = False, drop_flag: bool = False,
         traj_index: int = 0) -> dict:
    """A TrajectorySummary record, what the group queue hands a group filter (no token arrays)."""
    summary = {"mode": "train", "group_id": 0, "episode_id": 0, "traj_index": traj_index,
               "env_type": "frozen_lake", "seed": 7, "num_turns": 1, "prompt_length": 3, "response_length": 2,
               "model_tokens": 2, "response_level_rewards": reward, "success": reward > 0,
               "stop_reason": "env_timeout" if env_timeout else "env_failed" if env_failed else "done",
               "env_timeout": env_timeout, "env_failed": env_failed, "drop_flag": drop_flag,
               "payload": payload_ref("trajectories", 0, traj_index, 100)}
    return decode(encode(summary, "TrajectorySummary"))[1]  # exactly as decoded from the table


def group(*rewards: float, **flags) -> list[dict]:
    return [traj(r, traj_index=i, **flags) for i, r in enumerate(rewards)]


# -- default ---------------------------------------------------------------------------------------

def test_default_group_filter_never_drops():
    f = GroupFilter(None, manager(), "train")
    for g in (group(0, 0, 0, 0), group(1, 1, env_timeout=True), [None, None], []):
        assert f.filter(0, 0, g) is False
        assert filter_group(f, 0, 0, g) == (False, "accepted", {})
    assert f.state_dict() == {}


def test_mode_must_be_train_or_val():
    with pytest.raises(ValueError, match="mode must be one of"):
        GroupFilter(None, manager(), "eval")


def test_default_path_in_config_is_the_default_filter():
    f = load_group_filter("default", None, manager(), "train")
    assert type(f) is GroupFilter and f.mode == "train"


# -- EnvFailureStdGroupFilter ------------------------------------------------------------------------

def test_env_failure_std_keeps_a_group_with_spread():
    f = EnvFailureStdGroupFilter(None, manager(), "train")
    assert f.filter(3, 11, group(1.0, 0.0, 0.0, 1.0)) is False
    assert f.reason == "accepted"
    assert f.decision_values == {"n": 4.0, "n_missing": 0.0, "env_timeout": 0.0, "env_failed": 0.0,
                                 "std": 0.5773502588272095, "std_threshold": 0.0, "mean": 0.5}


def test_env_failure_std_drops_zero_std_inclusive():
    f = EnvFailureStdGroupFilter(None, manager(), "train")
    assert filter_group(f, 0, 1, group(0.5, 0.5, 0.5, 0.5)) == (True, "zero_std", {
        "n": 4.0, "n_missing": 0.0, "env_timeout": 0.0, "env_failed": 0.0, "std": 0.0, "std_threshold": 0.0,
        "mean": 0.5})
    # threshold inclusive: unbiased std of [0, 1] is 0.70710677 (float32)
    f = EnvFailureStdGroupFilter(None, manager(group_size=2, std_threshold=0.70710677), "train")
    drop, reason, values = filter_group(f, 0, 1, group(0.0, 1.0))
    assert (drop, reason, values["std"]) == (True, "zero_std", 0.7071067690849304)
    f = EnvFailureStdGroupFilter(None, manager(group_size=2, std_threshold=0.7), "train")
    assert f.filter(0, 1, group(0.0, 1.0)) is False


def test_env_failure_std_drops_timeout_before_failure_before_std():
    f = EnvFailureStdGroupFilter(None, manager(), "train")
    g = [traj(0.0), traj(0.0, env_failed=True), traj(0.0, env_timeout=True), traj(0.0, env_timeout=True)]
    assert filter_group(f, 0, 0, g) == (True, "env_timeout", {
        "n": 4.0, "n_missing": 0.0, "env_timeout": 2.0, "env_failed": 1.0, "std": 0.0, "std_threshold": 0.0,
        "mean": 0.0})
    g = [traj(1.0), traj(0.0, env_failed=True), traj(0.0), traj(1.0)]
    drop, reason, values = filter_group(f, 0, 0, g)
    assert (drop, reason, values["env_failed"], values["env_timeout"]) == (True, "env_failed", 1.0, 0.0)


def test_env_failure_std_rejects_non_finite_or_missing_reward():
    f = EnvFailureStdGroupFilter(None, manager(), "train")
    drop, reason, values = filter_group(f, 0, 0, group(1.0, math.nan, 0.0, 1.0))
    assert (drop, reason) == (True, "invalid_reward")
    assert "std" not in values and values["n"] == 4.0
    g = group(1.0, 0.0)
    del g[1]["response_level_rewards"]
    assert filter_group(f, 0, 0, g)[:2] == (True, "invalid_reward")


def test_env_failure_std_negative_threshold_turns_the_std_rule_off():
    f = EnvFailureStdGroupFilter(None, manager(std_threshold=-1), "train")
    assert f.filter(0, 0, group(1, 1, 1, 1)) is False
    assert f.filter(0, 0, group(1, 1, 1, 1, env_failed=True)) is True and f.reason == "env_failed"


def test_env_failure_std_ignores_none_entries_and_keeps_all_none():
    f = EnvFailureStdGroupFilter(None, manager(), "train")
    assert f.filter(0, 0, [traj(1.0), None, traj(0.0), None]) is False
    assert f.decision_values["n"] == 2.0 and f.decision_values["n_missing"] == 2.0
    assert f.decision_values["std"] == 0.7071067690849304
    assert f.filter(0, 0, [None, traj(1.0, env_timeout=True), None, None]) is True
    assert f.reason == "env_timeout"
    # one valid trajectory: std 0 by definition -> zero_std
    assert filter_group(f, 0, 0, [None, traj(1.0), None, None]) == (True, "zero_std", {
        "n": 1.0, "n_missing": 3.0, "env_timeout": 0.0, "env_failed": 0.0, "std": 0.0, "mean": 1.0,
        "std_threshold": 0.0})
    assert filter_group(f, 0, 0, [None, None, None, None]) == (False, "accepted", {"n": 0.0, "n_missing": 4.0})


def test_env_failure_std_rejects_a_config_that_drops_everything():
    with pytest.raises(ConfigError, match="group_size 1"):
        EnvFailureStdGroupFilter(None, manager(group_size=1), "train")
    EnvFailureStdGroupFilter(None, manager(group_size=1, std_threshold=-1.0), "train")  # failures only: fine
    with pytest.raises(ConfigError, match="group_filter_config.std_threshold must be a number"):
        EnvFailureStdGroupFilter(None, manager(std_threshold="0.1"), "train")
    with pytest.raises(ConfigError, match="drop_in_val must be true or false"):
        EnvFailureStdGroupFilter(None, manager(drop_in_val="yes"), "val")


def test_val_mode_never_drops_unless_drop_in_val():
    bad = group(0, 0, 0, 0, env_timeout=True)
    f = EnvFailureStdGroupFilter(None, manager(), "val")
    assert filter_group(f, 0, 0, bad) == (False, "accepted", {
        "n": 4.0, "n_missing": 0.0, "env_timeout": 4.0, "env_failed": 0.0, "std": 0.0, "std_threshold": 0.0,
        "mean": 0.0})
    f = EnvFailureStdGroupFilter(None, manager(drop_in_val=True), "val")
    assert filter_group(f, 0, 0, bad)[:2] == (True, "env_timeout")

    flagged = group(0, 1, 0, 1, drop_flag=True)
    d = DropFlagGroupFilter(None, manager(), "val")
    for _ in range(4):
        assert d.filter(0, 0, flagged) is False
    assert (d.guard.total, d.guard.filtered) == (0, 0)  # val without drop_in_val makes no guard decision
    d = DropFlagGroupFilter(None, manager(drop_in_val=True), "val")
    assert [d.filter(0, e, flagged) for e in range(4)] == [False, True, False, True]


# -- DropFlagGroupFilter -----------------------------------------------------------------------------

def test_drop_flag_filter_follows_the_reference_guard():
    f = DropFlagGroupFilter(None, manager(), "train")
    clean = group(1, 0, 1, 0)
    flagged = [traj(0.0), traj(1.0, drop_flag=True), traj(0.0), traj(1.0)]
    pattern = [0, 0, 1, 1, 1, 0, 1, 1, 1, 1]  # vectors "mixed"
    out = [filter_group(f, 0, e, flagged if c else clean) for e, c in enumerate(pattern)]
    assert [drop for drop, _, _ in out] == [False, False, True, True, False, False, True, True, False, True]
    assert {reason for drop, reason, _ in out if drop} == {"drop_flag"}
    assert {reason for drop, reason, _ in out if not drop} == {"accepted"}
    assert out[2][2] == {"candidate": 1.0, "n_flagged": 1.0, "n": 4.0, "n_missing": 0.0, "total": 3.0, "filtered": 1.0}
    assert out[5][2] == {"candidate": 0.0, "n_flagged": 0.0, "n": 4.0, "n_missing": 0.0, "total": 6.0, "filtered": 2.0}
    assert (f.guard.total, f.guard.filtered) == (10, 5)


def test_drop_flag_filter_none_entries_and_all_none():
    f = DropFlagGroupFilter(None, manager(), "train")
    # the reference raises AttributeError here
    assert f.filter(0, 0, [None, traj(0.0, drop_flag=True), None, traj(1.0)]) is False  # call 1: 1/1 > 0.5
    assert f.decision_values["n_missing"] == 2.0 and f.decision_values["n_flagged"] == 1.0
    assert f.filter(0, 1, [traj(0.0, drop_flag=True), None, None, None]) is True  # call 2: 1/2
    assert f.reason == "drop_flag"
    assert filter_group(f, 0, 2, [None, None, None, None]) == (False, "accepted", {
        "candidate": 0.0, "n_flagged": 0.0, "n": 0.0, "n_missing": 4.0})
    assert (f.guard.total, f.guard.filtered) == (2, 1)  # an all-None group is no guard decision


def test_drop_flag_filter_window_mode_from_config():
    f = DropFlagGroupFilter(None, manager(ratio_mode="window", max_ratio=0.25, window=4), "train")
    flagged = group(0, 1, drop_flag=True)
    out = [f.filter(0, e, flagged) for e in range(8)]
    assert out == [False, False, False, True, False, False, False, True]
    assert f.decision_values == {"candidate": 1.0, "n_flagged": 2.0, "n": 2.0, "n_missing": 0.0, "total": 8.0,
                                 "filtered": 2.0, "window_drops": 1.0}


def test_drop_flag_filter_state_round_trip():
    cfg = manager(ratio_mode="window", max_ratio=0.5, window=6)
    f = DropFlagGroupFilter(None, cfg, "train")
    flags = [True, False, True, True, True, False, True, True, True, True, False, True]
    for e, flag in enumerate(flags[:6]):
        f.filter(0, e, group(0, 1, drop_flag=flag))
    state = json.loads(json.dumps(f.state_dict()))
    g = DropFlagGroupFilter(None, cfg, "train")
    g.load_state_dict(state)
    rest = [(f.filter(0, e, group(0, 1, drop_flag=flag)), g.filter(0, e, group(0, 1, drop_flag=flag)))
            for e, flag in enumerate(flags[6:])]
    assert all(a == b for a, b in rest)
    assert f.state_dict() == g.state_dict()
    with pytest.raises(ValueError, match="'guard' entry"):
        g.load_state_dict({"total": 1})


@pytest.mark.parametrize("cfg,match", [
    ({"ratio_mode": "sliding"}, "ratio_mode must be one of"),
    ({"max_ratio": 2}, "max_ratio must be a number in"),
    ({"max_ratio": None}, "group_filter_config.max_ratio must be a number"),
    ({"window": 0}, "window must be an int >= 1"),
])
def test_drop_flag_filter_bad_config_is_a_config_error(cfg, match):
    with pytest.raises(ConfigError, match=match):
        DropFlagGroupFilter(None, manager(**cfg), "train")


# -- load_group_filter and filter_group ---------------------------------------------------------------

class DropOddEpisodes:
    """A custom filter as users write it: True drops."""

    def __init__(self, config, env_manager_config, mode):
        self.mode = mode
        self.group_size = env_manager_config.group_size
        self.reason = "group_filter"

    def filter(self, group_id, episode_id, group):
        self.decision_values = {"episode_parity": episode_id % 2, "label": "not a number"}
        return episode_id % 2 == 1


class ReasonedFilter:
    def __init__(self, config, env_manager_config, mode):
        self.reason = "env_failed"

    def filter(self, group_id, episode_id, group):
        return bool(group_id)


class UnknownReasonFilter(ReasonedFilter):
    def __init__(self, config, env_manager_config, mode):
        self.reason = "my_private_reason"


class ExplodingFilter:
    def __init__(self, config, env_manager_config, mode):
        pass

    def filter(self, group_id, episode_id, group):
        raise RuntimeError("bug in user filter")


class NoFilterMethod:
    def __init__(self, config, env_manager_config, mode):
        pass


class FilterIsNotCallable:
    filter = 3

    def __init__(self, config, env_manager_config, mode):
        pass


class WrongSignature:
    def __init__(self):
        pass

    def filter(self, group_id, episode_id, group):
        return False


def build_filter_object(config, env_manager_config, mode):
    """A factory is accepted too: anything that returns an object with a callable filter."""
    return DropOddEpisodes(config, env_manager_config, mode)


@pytest.mark.parametrize("path,cls", [
    (ENV_FAILURE_STD, EnvFailureStdGroupFilter),
    (DROP_FLAG, DropFlagGroupFilter),
    ("rollstream.filtering.group_filters.DropFlagGroupFilter", DropFlagGroupFilter),
    (f"{__name__}:DropOddEpisodes", DropOddEpisodes),
    (f"{__name__}:build_filter_object", DropOddEpisodes),
])
def test_load_group_filter_by_path(path, cls):
    f = load_group_filter(path, None, manager(group_size=3), "val")
    assert type(f) is cls
    assert f.mode == "val"


def test_custom_filter_by_path_true_drops():
    f = load_group_filter(f"{__name__}:DropOddEpisodes", None, manager(group_size=3), "train")
    assert f.group_size == 3
    assert filter_group(f, 0, 2, group(0, 1, 0)) == (False, "accepted", {"episode_parity": 0.0})
    assert filter_group(f, 0, 3, group(0, 1, 0)) == (True, "group_filter", {"episode_parity": 1.0})


def test_custom_filter_reason_is_read_after_a_drop():
    f = load_group_filter(f"{__name__}:ReasonedFilter", None, manager(), "train")
    assert filter_group(f, 1, 0, group(0, 1)) == (True, "env_failed", {})
    assert filter_group(f, 0, 0, group(0, 1)) == (False, "accepted", {})
    f = load_group_filter(f"{__name__}:UnknownReasonFilter", None, manager(), "train")
    assert filter_group(f, 1, 0, group(0, 1)) == (True, "group_filter", {})


def test_raising_custom_filter_drops_with_filter_error(caplog):
    f = load_group_filter(f"{__name__}:ExplodingFilter", None, manager(), "train")
    assert filter_group(f, 5, 9, group(0, 1)) == (True, "filter_error", {})
    assert "bug in user filter" in caplog.text and "group 5 episode 9" in caplog.text


@pytest.mark.parametrize("path,match", [
    ("no.such.module:Filter", "cannot import group_filter_cls 'no.such.module:Filter'"),
    ("rollstream.filtering.group_filters:NoSuchClass", "NoSuchClass"),
    ("", r"group_filter_cls must be a built-in name \['default', 'env_failure_std', 'drop_flag'\] or an import path"),
    ("dropflag", r"unknown group_filter_cls 'dropflag'; valid: \['default', 'drop_flag', 'env_failure_std'\]"),
    (f"{__name__}:NoFilterMethod", r"NoFilterMethod' is a class \(it lacks filter\), not a group filter class"),
    (f"{__name__}:FilterIsNotCallable", r"FilterIsNotCallable' is a class \(it lacks filter\)"),
    (f"{__name__}:WrongSignature", "WrongSignature' could not be built"),
    (f"{__name__}:DROP_FLAG_NOT_A_CLASS", "is not callable"),
])
def test_bad_paths_raise_config_error(path, match):
    with pytest.raises(ConfigError, match=match):
        load_group_filter(path, None, manager(), "train")


DROP_FLAG_NOT_A_CLASS = "just a string"


def test_builtin_construction_errors_name_the_path_and_the_key():
    with pytest.raises(ConfigError, match=r"DropFlagGroupFilter' could not be built.*ratio_mode"):
        load_group_filter(DROP_FLAG, None, manager(ratio_mode="nope"), "train")
    with pytest.raises(ConfigError, match="mode must be one of"):
        load_group_filter(DROP_FLAG, None, manager(), "test")
    assert issubclass(UnknownFilterError, ConfigError)


def test_one_instance_per_mode_keeps_separate_state():
    train = load_group_filter(DROP_FLAG, None, manager(drop_in_val=True), "train")
    val = load_group_filter(DROP_FLAG, None, manager(drop_in_val=True), "val")
    flagged = group(0, 1, drop_flag=True)
    assert [train.filter(0, e, flagged) for e in range(2)] == [False, True]
    assert val.filter(0, 0, flagged) is False  # its own call 1
    assert (train.guard.total, val.guard.total) == (2, 1)


@pytest.mark.parametrize("name,cls", [("default", GroupFilter), ("env_failure_std", EnvFailureStdGroupFilter),
                                      ("drop_flag", DropFlagGroupFilter), (DROP_FLAG, DropFlagGroupFilter)])
def test_a_built_in_is_named_by_its_name_or_its_import_path(name, cls):
    assert type(load_group_filter(name, None, manager(), "train")) is cls
    assert EnvManagerConfig(num_env_groups=2, group_size=4, tags=["t"], group_filter_cls=name).group_filter_cls == name
