"""A filter's verdict: keep or not, why, and the values the rule used."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from rollstream.filtering.reasons import ACCEPTED, RejectReason


@dataclass(frozen=True)
class Decision:
    keep: bool
    reason: str = ACCEPTED  # "accepted" or a RejectReason value
    values: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def accept(cls, **values: float) -> "Decision":
        return cls(True, ACCEPTED, dict(values))

    @classmethod
    def reject(cls, reason: RejectReason | str, **values: float) -> "Decision":
        return cls(False, str(reason), dict(values))
