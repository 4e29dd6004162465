"""check_query_filter_args: the built-in query filters' arguments, checked before a run starts."""

from __future__ import annotations

import re

import pytest

from rollstream.exceptions import ConfigError
from rollstream.filtering.query_filters import QUERY_FILTER_ARGS, check_query_filter_args


def test_each_built_in_filter_lists_the_keys_it_reads():
    assert QUERY_FILTER_ARGS == {"no_filter": set(), "mean_filter": {"threshold_down", "threshold_up"},
                                 "std_filter": {"std_threshold"}}


@pytest.mark.parametrize("filter_type, args", [
    ("no_filter", {}),
    ("std_filter", {"std_threshold": 0.0}),
    ("std_filter", {"std_threshold": 1}),
    ("mean_filter", {"threshold_down": 0.1, "threshold_up": 0.9}),
    ("mean_filter", {"threshold_down": 0.5, "threshold_up": 0.5}),
    ("mean_filter", {"threshold_up": 0.5}),
    ("my_pkg.filters:keep_all", {"anything": "goes"}),  # a custom filter takes any arguments
])
def test_valid_arguments_pass(filter_type, args):
    assert check_query_filter_args(filter_type, args) is None


@pytest.mark.parametrize("filter_type, args, message", [
    ("std_filter", {"std_thresold": 0.5},
     "query_filter_config.filter_args: unknown ['std_thresold'] for std_filter; valid: ['std_threshold']"),
    ("no_filter", {"std_threshold": 0.5}, "query_filter_config.filter_args: unknown ['std_threshold'] for no_filter; valid: []"),
    ("std_filter", {"std_threshold": "abc"}, "query_filter_config.filter_args.std_threshold must be a number, got 'abc'"),
    ("std_filter", {"std_threshold": True}, "query_filter_config.filter_args.std_threshold must be a number, got True"),
    ("mean_filter", {"threshold_down": 0.9, "threshold_up": 0.1},
     "query_filter_config.filter_args: threshold_down > threshold_up rejects every group"),
    ("mean_filter", {"threshold_up": -2.0}, "threshold_down > threshold_up rejects every group"),  # default down -1
])
def test_invalid_arguments_raise_config_error(filter_type, args, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_query_filter_args(filter_type, args)
