"""Reward functions named by a domain's ``reward_type``: a built-in name or a user import path.

The built-ins are rollstream.extensions.REWARDS. A user function is named ``pkg.module:function``;
its module is imported when the config loads (installed, on ``PYTHONPATH`` or under the working
directory, as every extension), so a typo fails before anything starts.

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

import inspect
import pickle
from typing import Callable

from rollstream.exceptions import ConfigError
from rollstream.extensions import REWARDS

INFO_KEYS = ("prompt_id", "domain", "mode", "prompt", "messages", "sample_index", "round",
             "finish_reason", "response_length", "policy_version")
"""What ``**info`` carries per response: the Response's identity and context. ``messages`` is the
prompt's chat messages (``[]`` for a plain-text prompt), ``response_length`` the number of sampled
tokens, ``finish_reason`` ``stop``, ``length`` or ``abort``."""


def is_builtin(reward_type: str) -> bool:
    return reward_type in REWARDS


def load_reward_function(reward_type: str, batched: bool = False) -> Callable:
    """The function ``reward_type`` names (rollstream.extensions.REWARDS: a built-in, or a user's
    ``pkg.module:function``), checked.

    Raises ConfigError when the name is unknown, the module or attribute is missing, the module
    fails to import, the object is not callable or does not pickle by reference, or it cannot be
    called with two positional arguments (three when ``batched``)."""
    if ":" not in reward_type and not is_builtin(reward_type):
        raise ConfigError(f"reward_type {reward_type!r} is neither a built-in {list(REWARDS)} "
                          "nor an import path 'pkg.module:function'")
    fn = REWARDS.get_named(reward_type)
    if is_builtin(reward_type):
        return fn
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
