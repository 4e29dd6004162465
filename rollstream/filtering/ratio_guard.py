"""A guard that caps the share of groups the drop_flag group filter may drop.

Two modes:

``cumulative`` (the default) is the reference system's guard: two
counters that are never reset. Every decision adds 1 to ``total``, candidate or not. A
non-candidate is kept. A candidate is kept when ``filtered / total >= max_ratio`` or when
``(filtered + 1) / total > max_ratio``; otherwise ``filtered += 1`` and the group is dropped. The
first test is implied by the second, so the effective rule is: drop a candidate iff
``(filtered + 1) / total <= max_ratio``, with ``total`` already counting the current decision.
With ``max_ratio = 0.5`` this is the reference's hard-coded 50 % rule, and it reproduces every call
of the ``drop_flag_ratio_guard`` vectors. As the reference's docs say, this bounds the share over
the whole run, not over any recent stretch: after a long clean period the guard may drop many
groups in a row.

``window`` is our strict limiter, a deliberate difference from the reference. It remembers the
outcomes of the last ``window`` decisions (candidate or not) and drops a candidate iff, counting
the current decision as a drop, the dropped share of the last ``m`` decisions stays within
``max_ratio``, where ``m = min(decisions remembered + 1, window)``::

    drop  iff  candidate and (drops among the previous m - 1 decisions + 1) / m <= max_ratio

Guarantees (tested in tests/filtering/test_ratio_guard.py):

* every contiguous run of ``window`` decisions holds at most ``floor(max_ratio * window)`` drops;
* every prefix of ``n < window`` decisions holds at most ``floor(max_ratio * n)`` drops, i.e. the
  observed share never exceeds ``max_ratio`` while the window is still filling. Why the prefix
  uses its own length and not ``window``: padding a young history with imaginary keeps would let a
  fresh guard drop ``floor(max_ratio * window)`` groups in a row at start-up (the first 50 of 100
  groups, all dropped), which is exactly the excess the guard exists to prevent. With the prefix
  rule the first ``window`` decisions are identical to the cumulative mode's;
* it is not conservative: a candidate is kept only when dropping it would break the first or
  second guarantee for the run ending at it (with all candidates and 0.5 / 10 it drops exactly
  every second group, 5 of every 10).

Within a window the drops may still come in a burst (after ``window`` clean decisions, up to
``floor(max_ratio * window)`` candidates in a row are dropped): the limit is on the share per
window, not on run length.

Ratios are compared as ``count / length <= max_ratio`` in float arithmetic, as the reference
does, so ``max_ratio = 0.57`` with a window of 100 allows 57 drops (``floor(0.57 * 100)`` in floats
would give 56).

Both modes are O(1) per decision and serialisable with :meth:`DropFlagRatioGuard.state_dict`.
"""

from __future__ import annotations

import math
from collections import deque
from numbers import Real
from typing import Any, Literal, Mapping

RatioMode = Literal["cumulative", "window"]
RATIO_MODES: tuple[str, ...] = ("cumulative", "window")


class DropFlagRatioGuard:
    """Decides whether a drop candidate is really dropped, capping the dropped share.

    Args:
        mode: ``"cumulative"`` (the reference's arithmetic) or
            ``"window"`` (strict limit over the last ``window`` decisions, module docstring).
        max_ratio: the largest share of dropped groups, in [0, 1]. 0 never drops, 1 drops every
            candidate. The reference hard-codes 0.5.
        window: decisions the ``window`` mode looks back over, >= 1 (validated in both modes).

    Raises:
        ValueError: unknown mode, max_ratio not a finite number in [0, 1], window not an int >= 1.

    Attributes:
        total: decisions made so far (candidates and non-candidates), never reset.
        filtered: candidates dropped so far, never reset.
    """

    def __init__(self, mode: RatioMode = "cumulative", max_ratio: float = 0.5, window: int = 100) -> None:
        if mode not in RATIO_MODES:
            raise ValueError(f"ratio guard mode must be one of {list(RATIO_MODES)}, got {mode!r}")
        if isinstance(max_ratio, bool) or not isinstance(max_ratio, Real) or not math.isfinite(max_ratio) \
                or not 0.0 <= max_ratio <= 1.0:
            raise ValueError(f"ratio guard max_ratio must be a number in [0, 1], got {max_ratio!r}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"ratio guard window must be an int >= 1, got {window!r}")
        self.mode: str = mode
        self.max_ratio: float = float(max_ratio)
        self.window: int = window
        self.total: int = 0
        self.filtered: int = 0
        # window mode: outcomes (True = dropped) of the last `window` decisions, oldest first
        self._recent: deque[bool] = deque(maxlen=window)
        self._recent_drops = 0

    @property
    def window_drops(self) -> int:
        """Drops among the last ``min(total, window)`` decisions (window mode; 0 in cumulative)."""
        return self._recent_drops

    def decide(self, candidate: bool) -> bool:
        """Record one decision; returns True when the group is DROPPED.

        Args:
            candidate: whether the group asks to be dropped (any drop_flag).

        Returns:
            True to drop, False to keep. A non-candidate is always kept, and still counts.
        """
        candidate = bool(candidate)
        if self.mode == "cumulative":
            return self._decide_cumulative(candidate)
        return self._decide_window(candidate)

    def _decide_cumulative(self, candidate: bool) -> bool:
        # the reference's guard, with its hard-coded 0.5 generalised to max_ratio
        self.total += 1
        if not candidate:
            return False
        if self.filtered / self.total >= self.max_ratio:
            return False
        if (self.filtered + 1) / self.total > self.max_ratio:
            return False
        self.filtered += 1
        return True

    def _decide_window(self, candidate: bool) -> bool:
        recent = self._recent
        full = len(recent) == self.window
        # the previous m - 1 decisions are the remembered ones, less the oldest when it falls out
        previous_drops = self._recent_drops - (1 if full and recent[0] else 0)
        m = min(len(recent), self.window - 1) + 1
        drop = candidate and (previous_drops + 1) / m <= self.max_ratio
        if full and recent[0]:
            self._recent_drops -= 1
        recent.append(drop)  # evicts the oldest when full
        if drop:
            self._recent_drops += 1
            self.filtered += 1
        self.total += 1
        return drop

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state: ``{mode, max_ratio, window, total, filtered, recent}``.

        ``recent`` is the list of the last ``min(total, window)`` outcomes (True = dropped),
        oldest first; empty in cumulative mode.
        """
        return {
            "mode": self.mode, "max_ratio": self.max_ratio, "window": self.window,
            "total": self.total, "filtered": self.filtered, "recent": list(self._recent),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the counters and the window history saved by :meth:`state_dict`.

        The guard's own mode, max_ratio and window (from the current configuration) are kept;
        the stored ones are informational. ``total`` and ``filtered`` carry over in both modes.
        In window mode the last ``window`` stored outcomes are restored; a state without them
        (saved in cumulative mode) starts an empty window, which then fills as a prefix (module
        docstring). In cumulative mode ``recent`` is ignored.

        Raises:
            ValueError: not a mapping; total/filtered not ints with 0 <= filtered <= total;
                recent not a list of bools, longer than total, or with more drops than filtered.
        """
        if not isinstance(state, Mapping):
            raise ValueError(f"ratio guard state must be a mapping, got {type(state).__name__}")
        total, filtered = state.get("total"), state.get("filtered")
        for name, value in (("total", total), ("filtered", filtered)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"ratio guard state {name} must be an int >= 0, got {value!r}")
        if filtered > total:
            raise ValueError(f"ratio guard state has filtered {filtered} > total {total}")
        recent = state.get("recent", [])
        if not isinstance(recent, list) or not all(isinstance(x, bool) for x in recent):
            raise ValueError("ratio guard state recent must be a list of bools")
        if len(recent) > total or sum(recent) > filtered:
            raise ValueError(f"ratio guard state recent ({len(recent)} outcomes, {sum(recent)} drops) "
                             f"is inconsistent with total {total} / filtered {filtered}")
        self.total, self.filtered = total, filtered
        self._recent = deque(recent[-self.window:] if self.mode == "window" else [], maxlen=self.window)
        self._recent_drops = sum(self._recent)

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> "DropFlagRatioGuard":
        """A guard built with the stored mode, max_ratio and window, then loaded.

        Raises: ValueError as ``__init__`` and :meth:`load_state_dict`.
        """
        if not isinstance(state, Mapping):
            raise ValueError(f"ratio guard state must be a mapping, got {type(state).__name__}")
        guard = cls(state.get("mode", "cumulative"), state.get("max_ratio", 0.5), state.get("window", 100))
        guard.load_state_dict(state)
        return guard

    def __repr__(self) -> str:
        return (f"DropFlagRatioGuard(mode={self.mode!r}, max_ratio={self.max_ratio}, window={self.window}, "
                f"total={self.total}, filtered={self.filtered})")
