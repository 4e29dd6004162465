"""One extension idiom: a registry of built-ins by name, a user's object by import path."""

from __future__ import annotations

import pytest

from rollstream.estimators import ADV_ESTIMATORS
from rollstream.config.reward_functions import BUILTIN_REWARD_TYPES, REWARD_FUNCTIONS
from rollstream.exceptions import ConfigError
from rollstream.filtering.group_filters import GROUP_FILTERS
from rollstream.filtering.registry import QUERY_FILTERS, RESPONSE_FILTERS
from rollstream.registry import Registry


def double(x):
    return 2 * x


def test_built_ins_by_name_registered_or_by_path_and_users_objects_by_import_path():
    registry: Registry = Registry("thing", builtins={"lazy": "tests.test_registry:double"})

    @registry.register("eager")
    def triple(x):
        return 3 * x

    assert registry.names() == ("lazy", "eager") and list(registry) == ["lazy", "eager"] and len(registry) == 2
    assert registry["lazy"] is double and registry.get_named("eager") is triple
    assert registry.get_named("tests.test_registry:double") is double  # an import path, not registered
    assert "tests.test_registry:double" not in registry
    with pytest.raises(ConfigError, match=r"unknown thing 'nope'; valid: \['eager', 'lazy'\] or an import path"):
        registry.get_named("nope")
    with pytest.raises(ConfigError, match="cannot import thing 'tests.test_registry:missing'"):
        registry.get_named("tests.test_registry:missing")
    with pytest.raises(ValueError, match="thing 'eager' is already registered"):
        registry.register("eager")(double)


def test_every_extension_point_is_a_registry_with_its_built_ins_listed_once():
    assert (QUERY_FILTERS.names(), RESPONSE_FILTERS.names()) == (("no_filter", "mean_filter", "std_filter"),
                                                                 ("no_filter", "default"))
    assert GROUP_FILTERS.names() == ("default", "env_failure_std", "drop_flag")
    assert BUILTIN_REWARD_TYPES == REWARD_FUNCTIONS.names() == ("gsm8k", "math", "reasoning_gym")
    assert ADV_ESTIMATORS.names() == ("grpo", "dr_grpo", "rloo")
    assert all(callable(ADV_ESTIMATORS[name]) for name in ADV_ESTIMATORS)  # every lazy path resolves
