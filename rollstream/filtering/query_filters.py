"""Query (prompt-group) filters: one decision over the rewards of all responses to a prompt.

Semantics follow the reference system:

* ``mean_filter`` drops when ``mean <= threshold_down`` or ``mean >= threshold_up``
  (inclusive; defaults -1 and +inf).
* ``std_filter`` drops when ``std <= std_threshold`` (inclusive; default -1), with the
  unbiased (n-1) standard deviation.
* Mean and std are computed in float32 by torch and compared against float32-rounded
  thresholds, so borderline decisions match the reference exactly (vectors ``query_filter``).
  torch is imported at the first decision, not with this module: the stages that only load the
  config or count metrics never pay its ~5 CPU-s import.
* A group of one response is kept: its std is undefined and its mean alone says nothing
  about within-group advantage.

Where we differ on purpose:

* A non-finite reward rejects the group with ``invalid_reward`` (the reference keeps it,
  because every comparison with NaN is false).
* An unknown ``type`` is a ConfigError at start-up (the reference silently keeps).
* Integer rewards are converted to float (the reference raises RuntimeError).
* There is no "one-element list holding the whole group" quirk: the input is always the flat
  list of per-response rewards.
"""

from __future__ import annotations

import functools
import importlib
import math
import threading
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

from rollstream.exceptions import ConfigError
from rollstream.filtering.decision import Decision
from rollstream.filtering.reasons import RejectReason
from rollstream.extensions import QUERY_FILTERS
from rollstream.filtering.registry import resolve_filter

if TYPE_CHECKING:
    import torch

QueryFilterFn = Callable[["torch.Tensor", Mapping[str, Any]], Decision]
"""(rewards: (n,) float32 tensor, filter_args) -> Decision."""

QUERY_FILTER_ARGS: dict[str, frozenset[str]] = {
    "no_filter": frozenset(),
    "mean_filter": frozenset({"threshold_down", "threshold_up"}),
    "std_filter": frozenset({"std_threshold"}),
}
"""The ``filter_args`` keys each built-in filter reads. A misspelt key would silently fall back
to a default that keeps every group, so it is an error; custom filters take anything."""


F32_ROUNDS_TO_INF = 2.0**128 - 2.0**103
"""Doubles of at least this magnitude round to +-inf in float32 (round to nearest even)."""


@functools.lru_cache(maxsize=1024)
def _f32_of(x: float) -> float:
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def f32(x: float) -> float:
    """``x`` rounded to float32 (round to nearest, overflow to inf), as torch converts it."""
    return _f32_of(float(x))


def load_torch() -> threading.Thread:
    """Start importing torch in a daemon thread and return it. Its first import takes ~3 s on two
    cores: a stream stage calls this before its app starts, so the import overlaps the consumer's
    group join and the tables' recovery (which mostly wait on the broker) instead of preceding
    them, and is done before the first decision in the common case. A decision that comes
    earlier waits for it once (Python's per-module import lock)."""
    thread = threading.Thread(target=importlib.import_module, args=("torch",), name="import-torch", daemon=True)
    thread.start()
    return thread


def float32_tensor(values: Sequence[float]) -> "torch.Tensor":
    """``values`` as a (n,) float32 torch tensor: what every query filter, built-in or custom, is
    given."""
    import torch

    return torch.from_numpy(np.array([float(v) for v in values], dtype=np.float32))


def no_filter(rewards: torch.Tensor, filter_args: Mapping[str, Any]) -> Decision:
    return Decision.accept()


def mean_filter(rewards: torch.Tensor, filter_args: Mapping[str, Any]) -> Decision:
    down = f32(filter_args.get("threshold_down", -1.0))
    up = f32(filter_args.get("threshold_up", math.inf))
    mean = float(rewards.mean())
    values = {"mean": mean, "threshold_down": down, "threshold_up": up}
    if mean <= down:
        return Decision.reject(RejectReason.MEAN_TOO_LOW, **values)
    if mean >= up:
        return Decision.reject(RejectReason.MEAN_TOO_HIGH, **values)
    return Decision.accept(**values)


def std_filter(rewards: torch.Tensor, filter_args: Mapping[str, Any]) -> Decision:
    threshold = f32(filter_args.get("std_threshold", -1.0))
    std = float(rewards.std())  # unbiased, like torch's default in the reference
    values = {"std": std, "std_threshold": threshold, "mean": float(rewards.mean())}
    if std <= threshold:
        return Decision.reject(RejectReason.ZERO_STD, **values)
    return Decision.accept(**values)


def check_query_filter_args(filter_type: str, filter_args: Mapping[str, Any]) -> None:
    """Check a built-in filter's ``filter_args``: known keys only, numbers only, and a
    ``mean_filter`` band that can keep something. Custom filter types are not checked.

    Raises ConfigError naming the key, e.g. ``query_filter_config.filter_args: unknown
    ['std_thresold'] for std_filter; valid: ['std_threshold']``.
    """
    known = QUERY_FILTER_ARGS.get(filter_type)
    if known is None:
        return
    unknown = sorted(set(filter_args) - known)
    if unknown:
        raise ConfigError(f"query_filter_config.filter_args: unknown {unknown} for {filter_type}; valid: {sorted(known)}")
    for key, value in filter_args.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"query_filter_config.filter_args.{key} must be a number, got {value!r}")
    if filter_type == "mean_filter" and (
            filter_args.get("threshold_down", -1.0) > filter_args.get("threshold_up", math.inf)):
        raise ConfigError("query_filter_config.filter_args: threshold_down > threshold_up rejects every group")


def resolve_query_filter(config: Mapping[str, Any]) -> QueryFilterFn:
    """The filter function a ``query_filter_config`` names (registered name or import path).

    A custom filter is any callable ``(rewards: torch.Tensor (n,) float32, filter_args) ->
    bool | Decision`` where True keeps. Raises UnknownFilterError (a ConfigError).
    """
    return resolve_filter(QUERY_FILTERS, config.get("type", "no_filter"))


def query_decider(config: Mapping[str, Any]) -> Callable[[Sequence[float]], Decision]:
    """The decision of ``config`` (a domain's ``query_filter_config`` mapping ``{type,
    filter_args}``) with its filter resolved once: ``decide(rewards) -> Decision`` (see
    decide_query). Raises ConfigError for an unknown type."""
    fn = resolve_query_filter(config)
    filter_args = config.get("filter_args") or {}

    def decide(rewards: Sequence[float]) -> Decision:
        if len(rewards) == 0:
            raise ValueError("query filter needs at least one reward (empty group)")
        floats = [float(r) for r in rewards]
        # non-finite in float32: NaN, +-inf, or beyond float32's range (rounds to inf)
        bad = sum(1 for v in floats if not -F32_ROUNDS_TO_INF < v < F32_ROUNDS_TO_INF)
        if bad:
            return Decision.reject(RejectReason.INVALID_REWARD, non_finite=float(bad), n=float(len(rewards)))
        if len(rewards) == 1:
            return Decision.accept(mean=f32(floats[0]), n=1.0)
        if not isinstance(filter_args, Mapping):
            raise ConfigError(f"query_filter_config.filter_args must be a mapping, got {filter_args!r}")
        return fn(float32_tensor(floats), filter_args)

    return decide


def decide_query(rewards: Sequence[float], config: Mapping[str, Any]) -> Decision:
    """Decide one prompt group from its per-response rewards.

    Args:
        rewards: one float per response of the prompt, in sample order.
        config: the domain's ``query_filter_config`` mapping ``{type, filter_args}``.

    Returns: Decision (keep, reason, values used).
    Raises: ValueError for an empty group; ConfigError for an unknown type. A stage deciding
    many groups by one config resolves it once with ``query_decider``.
    """
    return query_decider(config)(rewards)


def query_filter(rewards: Sequence[float], query_filter_config: Mapping[str, Any]) -> bool:
    """True keeps the prompt group (reference entry-point semantics); see decide_query."""
    return decide_query(rewards, query_filter_config).keep
