"""Query filters against the reference vectors (float32 semantics) and our documented differences."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from rollstream.exceptions import ConfigError
from rollstream.filtering import Decision, RejectReason, UnknownFilterError, decide_query, query_filter

VECTORS = json.loads((Path(__file__).resolve().parents[2] / "tests" / "vectors" / "roll_reference_vectors.json").read_text())
QF = VECTORS["query_filter"]

# Vectors whose reference outcome we deliberately change, by note.
DIFFERENT = {
    "NaN reward -> mean NaN -> comparisons False -> keep",  # we reject: invalid_reward
    "unrecognised type string -> falls through -> keep",  # we raise ConfigError
    # opt level 0 wrapped the whole group in a one-element list; our input is always flat
    "generate_opt_level=0 path passes [whole_group_DataProto] (a 1-element list) -> always keep regardless of rewards",
}
FAITHFUL = [v for v in QF if "keep" in v and v["note"] not in DIFFERENT]


def _flat(v: dict) -> list[float]:
    return [float(x) for element in v["rewards_per_list_element"] for x in element]


@pytest.mark.parametrize("vector", FAITHFUL, ids=[v["note"][:60] for v in FAITHFUL])
def test_reference_vector(vector):
    config = {"type": vector["type"], "filter_args": vector["filter_args"]}
    rewards = _flat(vector)
    decision = decide_query(rewards, config)
    assert decision.keep is vector["keep"]
    # the statistics each filter reports, checked exactly (float32, like the reference): no_filter
    # computes none, and a one-response group is kept before any std is taken
    reported = {"no_filter": (), "mean_filter": ("mean",),
                "std_filter": ("mean", "std") if len(rewards) > 1 else ("mean",)}
    for key in reported[vector["type"]]:
        assert decision.values[key] == vector["torch_std_unbiased" if key == "std" else "torch_mean"]


def test_float32_rounding_decides_the_borderline_like_the_reference():
    cfg = {"type": "mean_filter", "filter_args": {"threshold_down": 0.15, "threshold_up": 0.9}}
    assert query_filter([0.1, 0.2], cfg) is False  # float64 would keep
    cfg = {"type": "mean_filter", "filter_args": {"threshold_down": 0.35, "threshold_up": 0.9}}
    assert query_filter([0.1, 0.6], cfg) is True


def test_mean_filter_drops_at_inclusive_bounds_with_reasons():
    cfg = {"type": "mean_filter", "filter_args": {"threshold_down": 0.0, "threshold_up": 1.0}}
    low = decide_query([0, 0, 0, 0], cfg)
    high = decide_query([1, 1, 1, 1], cfg)
    mid = decide_query([1, 0, 0, 0], cfg)
    assert (low.keep, low.reason) == (False, RejectReason.MEAN_TOO_LOW.value)
    assert (high.keep, high.reason) == (False, RejectReason.MEAN_TOO_HIGH.value)
    assert mid == Decision(True, "accepted", {"mean": 0.25, "threshold_down": 0.0, "threshold_up": 1.0})


def test_std_filter_reports_zero_std_with_values():
    d = decide_query([0.0, 0.0, 0.0, 0.0], {"type": "std_filter", "filter_args": {"std_threshold": 0}})
    assert (d.keep, d.reason) == (False, "zero_std")
    assert d.values == {"std": 0.0, "std_threshold": 0.0, "mean": 0.0}


def test_nan_reward_rejects_as_invalid_reward_instead_of_keeping():
    d = decide_query([math.nan, 1.0], {"type": "mean_filter", "filter_args": {"threshold_down": 0.1, "threshold_up": 0.9}})
    assert (d.keep, d.reason) == (False, "invalid_reward")
    assert d.values == {"non_finite": 1.0, "n": 2.0}
    assert decide_query([math.inf, 0.0], {"type": "no_filter"}).reason == "invalid_reward"


def test_unknown_type_is_a_config_error():
    with pytest.raises(UnknownFilterError, match="bogus_type"):
        decide_query([0.0, 0.0], {"type": "bogus_type", "filter_args": {}})
    assert issubclass(UnknownFilterError, ConfigError)


def test_whole_group_is_decided_not_short_circuited():
    # reference opt level 0 kept everything; a flat group of four all-wrong answers is dropped
    cfg = {"type": "mean_filter", "filter_args": {"threshold_down": 0.1, "threshold_up": 0.9}}
    assert query_filter([0.0, 0.0, 0.0, 0.0], cfg) is False


def test_single_response_is_kept_and_empty_group_raises():
    assert query_filter([1.0], {"type": "std_filter", "filter_args": {"std_threshold": 0}}) is True
    with pytest.raises(ValueError, match="empty group"):
        query_filter([], {"type": "std_filter"})


def test_integer_rewards_are_accepted_as_floats():
    assert query_filter([1, 0, 0, 0], {"type": "std_filter", "filter_args": {"std_threshold": 0}}) is True


def keep_if_any_perfect(rewards, filter_args):
    return bool((rewards >= filter_args.get("at_least", 1.0)).any())


def test_custom_filter_by_import_path():
    cfg = {"type": f"{__name__}:keep_if_any_perfect", "filter_args": {"at_least": 1.0}}
    assert query_filter([0.0, 1.0], cfg) is True
    d = decide_query([0.0, 0.5], cfg)
    assert (d.keep, d.reason) == (False, "custom_query_filter")


def test_unimportable_custom_filter_is_a_config_error():
    with pytest.raises(UnknownFilterError, match="cannot import"):
        query_filter([0.0, 1.0], {"type": "no.such.module:fn"})


def explode(rewards, filter_args):
    raise RuntimeError("bug in user filter")


def test_custom_filter_that_raises_rejects_with_filter_error():
    d = decide_query([0.0, 1.0], {"type": f"{__name__}:explode"})
    assert (d.keep, d.reason) == (False, "filter_error")


def test_load_torch_imports_it_in_a_thread_the_decisions_then_use():
    """A stage starts the import while its app starts; the import finishes in that thread and a
    decision afterwards finds torch loaded."""
    import sys

    from rollstream.filtering.query_filters import load_torch

    thread = load_torch()
    assert thread.daemon and thread.name == "import-torch"
    thread.join(timeout=120)
    assert not thread.is_alive() and "torch" in sys.modules
    config = {"type": "std_filter", "filter_args": {"std_threshold": 0.0}}
    assert decide_query([0.0, 1.0], config).keep and not decide_query([1.0, 1.0], config).keep
