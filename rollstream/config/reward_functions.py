"""Reward functions named by a domain's ``reward_type``: a built-in name or a user import path.

A user function is named ``pkg.module:function``. Its module is imported when the config loads
(like any ``import pkg.module``: installed, on ``PYTHONPATH``, or under the working directory,
which is added to ``sys.path`` as a last resort), so a typo fails before anything starts.

Per response (``reward_batched: false``)::

    fn(response_text: str, ground_truth: str, **info) -> float | dict

Per polled batch of one domain (``reward_batched: true``)::

    fn(response_texts: list[str], ground_truths: list[str], infos: list[dict]) -> list[float | dict]

A function that does not take ``**info`` receives only the ``info`` keys it names as parameters
(``INFO_KEYS``), so ``def exact_match(response, truth)`` works as is. The reward worker calls it
in a pool of worker processes (rollstream.workers.reward_pool): the function and its results
must pickle, so it is a module-level function (or a module-level callable object).
"""

from __future__ import annotations

import importlib
import inspect
import os
import pickle
import sys
from typing import Callable

from rollstream.exceptions import ConfigError
from rollstream.registry import Registry

REWARD_FUNCTIONS: Registry[Callable] = Registry("reward_type", builtins={
    "gsm8k": "rollstream.workers.rewards:gsm8k_reward",
    "math": "rollstream.workers.rewards:math_reward",
    "reasoning_gym": "rollstream.workers.rewards:reasoning_gym_reward",
})
"""The reward functions shipped with rollstream, by ``reward_type`` name: the one list of their
names. Their code (and the libraries it scores with) is imported when a reward worker first asks."""

BUILTIN_REWARD_TYPES = REWARD_FUNCTIONS.names()

INFO_KEYS = ("prompt_id", "domain", "mode", "prompt", "messages", "sample_index", "round",
             "finish_reason", "response_length", "policy_version")
"""What ``**info`` carries per response: the Response's identity and context. ``messages`` is the
prompt's chat messages (``[]`` for a plain-text prompt), ``response_length`` the number of sampled
tokens, ``finish_reason`` ``stop``, ``length`` or ``abort``."""


def is_builtin(reward_type: str) -> bool:
    return reward_type in REWARD_FUNCTIONS


def load_reward_function(reward_type: str, batched: bool = False) -> Callable:
    """The user function ``reward_type`` (``pkg.module:function``) names, checked.

    Raises ConfigError when it is not an import path, the module or attribute is missing, the
    module fails to import, the object is not callable or does not pickle by reference, or it
    cannot be called with two positional arguments (three when ``batched``)."""
    module_name, sep, attr = reward_type.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"reward_type {reward_type!r} is neither a built-in {list(BUILTIN_REWARD_TYPES)} "
                          "nor an import path 'pkg.module:function'")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())  # `rollstream` as a console script has no cwd on its path
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # a user module may fail to import with anything
        raise ConfigError(f"reward_type {reward_type!r}: cannot import {module_name!r}: {type(exc).__name__}: {exc}") from exc
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ConfigError(f"reward_type {reward_type!r}: module {module_name!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ConfigError(f"reward_type {reward_type!r} is not callable ({type(fn).__name__})")
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise ConfigError(f"reward_type {reward_type!r} must be a module-level function (the reward pool's "
                          f"processes receive it pickled): {exc}") from exc
    args = ([], [], []) if batched else ("", "")
    named = {} if batched else dict.fromkeys(info_keys(fn) or ())
    try:
        inspect.signature(fn).bind(*args, **named)
    except TypeError as exc:
        form = "(response_texts, ground_truths, infos)" if batched else "(response_text, ground_truth, **info)"
        raise ConfigError(f"reward_type {reward_type!r} cannot be called as {form}: {exc}") from exc
    except ValueError:
        pass  # no signature to inspect (some builtins): the call itself will tell
    return fn


def info_keys(fn: Callable) -> tuple[str, ...] | None:
    """The ``INFO_KEYS`` a per-response function takes: None = all (it has ``**info``)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except ValueError:
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    named = {p.name for p in params[2:]  # the first two take the text and the ground truth
             if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)}
    return tuple(k for k in INFO_KEYS if k in named)
