"""Agentic group filters: one decision over the trajectories of one episode (a GRPO group).

Contract (the reference system's; config field ``EnvManagerConfig.group_filter_cls``):

* The class is built once per mode as ``Cls(config, env_manager_config, mode)``: ``config`` is the
  AgenticConfig (None in tests), ``env_manager_config`` the EnvManagerConfig of that mode, ``mode``
  ``"train"`` or ``"val"``. The instance lives as long as the group queue and is never reset.
* ``filter(group_id, episode_id, group) -> bool`` is called once per complete group, where
  ``group`` is the list of trajectory summary dicts (``schemas/trajectory_summary.avsc``), a
  missing trajectory being None. A summary has every Trajectory field that decides (identity,
  ``step_rewards``, ``response_level_rewards``, ``success``, ``stop_reason``, the
  ``env_timeout`` / ``env_failed`` / ``drop_flag`` flags, ``error``, ``policy_version``) and the
  lengths (``num_turns``, ``prompt_length``, ``response_length``, ``model_tokens``), but not the
  turns' token arrays or text: those stay on the payload topic (``payload`` is a PayloadRef), so
  deciding never costs in proportion to trajectory length. A filter that needs the tokens is a
  trainer-side concern, not a group filter.

  **True means DROP the group** (a replacement episode is started); **False means KEEP it.** This is
  what the reference's code does; the reference's help text for ``group_filter_cls`` ("Return
  false to filter out group") says the opposite and is wrong.
* Optional attributes the caller reads through :func:`filter_group`: ``reason`` (a RejectReason
  value, read after a True return; missing or unknown means ``group_filter``), ``decision_values``
  (``dict[str, float]`` describing the last decision), and ``state_dict()`` /
  ``load_state_dict(state)`` for filters whose state must survive a restart.

Built-in filters (``group_filter_config`` keys in brackets):

* :class:`GroupFilter`: the default, never drops (reference ``agentic_pipeline.GroupFilter``).
* :class:`EnvFailureStdGroupFilter`: drops infra failures and groups without reward spread
  [``std_threshold``].
* :class:`DropFlagGroupFilter`: drops groups with a ``drop_flag``, under a ratio guard
  [``ratio_mode``, ``max_ratio``, ``window``].

Where the built-ins differ from the reference on purpose:

* In mode ``"val"`` they never drop unless ``drop_in_val: true``. The reference calls the filter in
  validation too and leaves the check to each filter (its docs tell users to add it).
* A None entry never crashes a filter: None entries are ignored when reading flags and rewards.
  The reference's drop_flag filter raises AttributeError on them.
  A group whose entries are all None is kept; the reference's queue never calls the filter on such
  a group but marks it complete, and keeping it matches that.
"""

from __future__ import annotations

import logging
import math
from numbers import Real
from typing import Any, Mapping, Sequence

from rollstream.exceptions import ConfigError
from rollstream.extensions import GROUP_FILTERS
from rollstream.filtering.query_filters import f32, float32_tensor, std_filter
from rollstream.filtering.ratio_guard import RATIO_MODES, DropFlagRatioGuard
from rollstream.filtering.reasons import ACCEPTED, RejectReason

log = logging.getLogger(__name__)

GROUP_FILTER_MODES: tuple[str, ...] = ("train", "val")
_REASONS = frozenset(r.value for r in RejectReason)

Trajectory = Mapping[str, Any]
"""A TrajectorySummary record (see the module doc)."""


def _group_filter_config(env_manager_config: Any) -> dict[str, Any]:
    cfg = getattr(env_manager_config, "group_filter_config", None)
    if cfg is None:
        return {}
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"group_filter_config must be a mapping, got {type(cfg).__name__}")
    return dict(cfg)


def _number(cfg: Mapping[str, Any], key: str, default: float) -> float:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, Real) or math.isnan(value):
        raise ConfigError(f"group_filter_config.{key} must be a number, got {value!r}")
    return float(value)


class GroupFilter:
    """The default group filter: never drops (reference ``agentic_pipeline.GroupFilter``).
    Also the base class of the built-ins.

    Args:
        config: the AgenticConfig, or None (tests). Unused here.
        env_manager_config: the mode's EnvManagerConfig (or None: empty group_filter_config).
            Reads ``group_filter_config["drop_in_val"]`` (bool, default False).
        mode: ``"train"`` or ``"val"``.

    Raises:
        ValueError: mode is not "train" or "val".
        ConfigError: group_filter_config is not a mapping or drop_in_val is not a bool.

    Attributes:
        reason: why the last group was dropped (a RejectReason value); ``"accepted"`` after a keep.
        decision_values: the values the last decision used (``dict[str, float]``).
    """

    def __init__(self, config: Any, env_manager_config: Any, mode: str) -> None:
        if mode not in GROUP_FILTER_MODES:
            raise ValueError(f"group filter mode must be one of {list(GROUP_FILTER_MODES)}, got {mode!r}")
        self.config = config
        self.env_manager_config = env_manager_config
        self.mode = mode
        self.group_filter_config = _group_filter_config(env_manager_config)
        drop_in_val = self.group_filter_config.get("drop_in_val", False)
        if not isinstance(drop_in_val, bool):
            raise ConfigError(f"group_filter_config.drop_in_val must be true or false, got {drop_in_val!r}")
        self.drop_in_val: bool = drop_in_val
        self.reason: str = ACCEPTED
        self.decision_values: dict[str, float] = {}

    @property
    def active(self) -> bool:
        """Whether this instance may drop at all: always in train, in val only with drop_in_val."""
        return self.mode == "train" or self.drop_in_val

    def filter(self, group_id: int, episode_id: int, group: Sequence[Trajectory | None]) -> bool:
        """Decide one complete group. **Returns True to DROP the group, False to KEEP it.**

        The default keeps every group.
        """
        return self._keep({})

    def _keep(self, values: dict[str, float]) -> bool:
        self.reason, self.decision_values = ACCEPTED, values
        return False

    def _drop(self, reason: RejectReason, values: dict[str, float]) -> bool:
        self.reason, self.decision_values = reason.value, values
        return True

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state to persist; the default filter has none."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; nothing to restore here."""


class EnvFailureStdGroupFilter(GroupFilter):
    """Drops groups with an infrastructure failure or without reward spread.

    The usual example of a custom group filter, as a built-in with a reason per rule. In order,
    ignoring None entries:

    1. any trajectory with ``env_timeout`` -> DROP, reason ``env_timeout``;
    2. any trajectory with ``env_failed`` -> DROP, reason ``env_failed``;
    3. any ``response_level_rewards`` missing or not finite -> DROP, reason ``invalid_reward``
       (a deliberate difference from the reference: a NaN reward never passes silently);
    4. the unbiased (n-1) standard deviation of ``response_level_rewards`` ``<= std_threshold``
       -> DROP, reason ``zero_std``. Same arithmetic as the RLVR ``std_filter``
       and the reference: float32, inclusive, threshold rounded to float32.
       A group with a single valid trajectory has std 0.0 by definition here (no spread, so no
       within-group advantage), hence it is dropped unless std_threshold < 0. This differs from the
       RLVR query filter, which keeps one response because there the group size is 1 by
       configuration; here a lone trajectory means the others are missing.

    Otherwise KEEP. ``filter`` returns **True to DROP**. Every group with no valid trajectory is
    kept (module docstring). In mode "val" nothing is dropped unless ``drop_in_val``; the values are
    still reported.

    ``group_filter_config``: ``std_threshold`` (number, default 0.0; a negative value turns rule 4
    off), ``drop_in_val`` (bool, default False).

    decision_values: ``n`` (valid trajectories), ``n_missing`` (None entries), ``env_timeout`` and
    ``env_failed`` (counts), and, when every reward is finite, ``std``, ``mean``, ``std_threshold``.

    Raises:
        ConfigError: std_threshold is not a number; or group_size < 2 with std_threshold >= 0
            (every group would be dropped as zero_std).
    """

    def __init__(self, config: Any, env_manager_config: Any, mode: str) -> None:
        super().__init__(config, env_manager_config, mode)
        self.std_threshold = _number(self.group_filter_config, "std_threshold", 0.0)
        group_size = getattr(env_manager_config, "group_size", None)
        if isinstance(group_size, int) and group_size < 2 and self.std_threshold >= 0:
            raise ConfigError(
                f"group_filter_config.std_threshold {self.std_threshold} with group_size {group_size}: a group "
                "of one trajectory has std 0 and every group would be dropped; use group_size >= 2 or a "
                "negative std_threshold")

    def filter(self, group_id: int, episode_id: int, group: Sequence[Trajectory | None]) -> bool:
        """**Returns True to DROP the group, False to KEEP it** (rules in the class docstring)."""
        valid = [t for t in group if t is not None]
        values: dict[str, float] = {"n": float(len(valid)), "n_missing": float(len(group) - len(valid))}
        if not valid:
            return self._keep(values)
        timeouts = sum(1 for t in valid if t.get("env_timeout"))
        failures = sum(1 for t in valid if t.get("env_failed"))
        values.update(env_timeout=float(timeouts), env_failed=float(failures))
        rewards = [t.get("response_level_rewards") for t in valid]
        finite = all(isinstance(r, Real) and not isinstance(r, bool) and math.isfinite(r) for r in rewards)
        zero_std = False
        if finite:
            if len(rewards) == 1:
                values.update(std=0.0, mean=f32(rewards[0]), std_threshold=f32(self.std_threshold))
                zero_std = 0.0 <= values["std_threshold"]
            else:
                std_decision = std_filter(float32_tensor(rewards), {"std_threshold": self.std_threshold})
                values.update(std_decision.values)
                zero_std = not std_decision.keep
        if not self.active:
            return self._keep(values)
        if timeouts:
            return self._drop(RejectReason.ENV_TIMEOUT, values)
        if failures:
            return self._drop(RejectReason.ENV_FAILED, values)
        if not finite:
            return self._drop(RejectReason.INVALID_REWARD, values)
        if zero_std:
            return self._drop(RejectReason.ZERO_STD, values)
        return self._keep(values)


class DropFlagGroupFilter(GroupFilter):
    """Drops groups that carry a ``drop_flag``, capped by a :class:`DropFlagRatioGuard`
    (the reference's ``agent_native_env_manager.GroupFilter``).

    A group is a candidate iff any of its non-None trajectories has a truthy ``drop_flag``. Every
    group the filter decides (candidate or not) is one guard decision; the guard says whether a
    candidate is really dropped. ``filter`` returns **True to DROP** (reason ``drop_flag``).

    Not a guard decision, and kept: a group whose entries are all None (the reference never calls
    its filter on one), and every group in mode "val" without ``drop_in_val``.

    The guard is per instance, hence per mode, shared by every group id and never reset, as in the
    reference; it survives a restart through :meth:`state_dict` / :meth:`load_state_dict`.

    ``group_filter_config``: ``ratio_mode`` ("cumulative" default, the reference's arithmetic, or
    "window"), ``max_ratio`` (default 0.5, the reference's value), ``window`` (default 100; used by
    the window mode), ``drop_in_val`` (bool, default False).

    decision_values: ``candidate`` (0/1), ``n_flagged``, ``n``, ``n_missing``, and after a guard
    decision ``total`` and ``filtered`` (the guard's counters after it), plus ``window_drops`` in
    window mode.

    Raises:
        ConfigError: ratio_mode, max_ratio or window invalid (see DropFlagRatioGuard).
    """

    def __init__(self, config: Any, env_manager_config: Any, mode: str) -> None:
        super().__init__(config, env_manager_config, mode)
        cfg = self.group_filter_config
        ratio_mode = cfg.get("ratio_mode", "cumulative")
        if ratio_mode not in RATIO_MODES:
            raise ConfigError(f"group_filter_config.ratio_mode must be one of {list(RATIO_MODES)}, got {ratio_mode!r}")
        max_ratio = _number(cfg, "max_ratio", 0.5)
        window = cfg.get("window", 100)
        try:
            self.guard = DropFlagRatioGuard(ratio_mode, max_ratio, window)
        except ValueError as exc:
            raise ConfigError(f"group_filter_config: {exc}") from exc

    def filter(self, group_id: int, episode_id: int, group: Sequence[Trajectory | None]) -> bool:
        """**Returns True to DROP the group, False to KEEP it** (rules in the class docstring)."""
        valid = [t for t in group if t is not None]
        flagged = sum(1 for t in valid if t.get("drop_flag"))
        values: dict[str, float] = {
            "candidate": float(flagged > 0), "n_flagged": float(flagged),
            "n": float(len(valid)), "n_missing": float(len(group) - len(valid)),
        }
        if not valid or not self.active:
            return self._keep(values)
        drop = self.guard.decide(flagged > 0)
        values.update(total=float(self.guard.total), filtered=float(self.guard.filtered))
        if self.guard.mode == "window":
            values["window_drops"] = float(self.guard.window_drops)
        return self._drop(RejectReason.DROP_FLAG, values) if drop else self._keep(values)

    def state_dict(self) -> dict[str, Any]:
        """``{"guard": DropFlagRatioGuard.state_dict()}`` (JSON-able)."""
        return {"guard": self.guard.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the guard's counters (the configured mode, max_ratio and window are kept).

        Raises: ValueError for a malformed state (see DropFlagRatioGuard.load_state_dict).
        """
        if not isinstance(state, Mapping) or "guard" not in state:
            raise ValueError("DropFlagGroupFilter state must be a mapping with a 'guard' entry")
        self.guard.load_state_dict(state["guard"])


def load_group_filter(path: str, config: Any, env_manager_config: Any, mode: str) -> Any:
    """The group filter class ``path`` names (a ``GROUP_FILTERS`` name, or an import path
    ``"pkg.module:Class"``; ``"pkg.module.Class"`` also works), built as
    ``Class(config, env_manager_config, mode)``, as the reference does.

    Returns: the instance; its ``filter(group_id, episode_id, group)`` returns True to DROP.

    Raises:
        ConfigError: the path does not import (UnknownFilterError, a subclass), the object has no
            callable ``filter``, or construction raised (the constructor's exception, e.g. a
            built-in's ConfigError for a bad group_filter_config key or ValueError for a mode
            other than "train" / "val", is wrapped and chained). The message names ``path``.
    """
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"group_filter_cls must be a built-in name {list(GROUP_FILTERS)} or an import path "
                          f"'pkg.module:Class', got {path!r}")
    cls = GROUP_FILTERS.get_named(path)
    try:
        instance = cls(config, env_manager_config, mode)
    except Exception as exc:
        raise ConfigError(f"group_filter_cls {path!r} could not be built as "
                          f"Class(config, env_manager_config, mode): {type(exc).__name__}: {exc}") from exc
    if not callable(getattr(instance, "filter", None)):
        raise ConfigError(f"group_filter_cls {path!r} built an object without a callable filter(...)")
    return instance


def filter_group(filter_obj: Any, group_id: int, episode_id: int,
                 group: Sequence[Trajectory | None]) -> tuple[bool, str, dict[str, float]]:
    """Call ``filter_obj.filter`` and read its verdict.

    Returns:
        ``(drop, reason, values)``. ``drop`` is True to DROP the group (the filter's return value,
        by truthiness, as the reference's ``if filter(...)``). ``reason`` is ``"accepted"`` when
        kept; when dropped it is the filter's ``reason`` attribute if that is a RejectReason value,
        else ``group_filter``. ``values`` is the filter's ``decision_values`` with the entries
        that convert to float (``{}`` when absent).

    A filter that raises (or returns something without a truth value) is a bug in that filter: the
    group is DROPPED with reason ``filter_error`` and the exception is logged. This follows the RLVR
    precedent (``registry.Registry.resolve``: a custom filter that raises rejects with
    ``filter_error``, and the rejected group is kept as rejected data for inspection, never
    trained on). The drop starts a replacement episode, and those are bounded by
    ``max_replaced_episodes``, so a filter that always raises stops its group ids instead of
    looping.
    """
    try:
        drop = bool(filter_obj.filter(group_id, episode_id, group))
    except Exception:
        log.exception("group filter %s raised on group %s episode %s", type(filter_obj).__name__, group_id, episode_id)
        return True, RejectReason.FILTER_ERROR.value, {}
    values: dict[str, float] = {}
    raw = getattr(filter_obj, "decision_values", None)
    if isinstance(raw, Mapping):
        for key, value in raw.items():
            try:
                values[str(key)] = float(value)
            except (TypeError, ValueError):
                continue
    if not drop:
        return False, ACCEPTED, values
    reason = getattr(filter_obj, "reason", None)
    reason = str(reason) if isinstance(reason, str) and str(reason) in _REASONS else RejectReason.GROUP_FILTER.value
    return True, reason, values
