"""A filter's verdict: keep or not, why, and the values the rule used."""

from __future__ import annotations

import hashlib
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


def config_hash(config_json: str) -> str:
    """The short id a filter config is recorded under beside a decision (``filter_config_hash``):
    the first 16 hex digits of the SHA-256 of its canonical JSON text."""
    return hashlib.sha256(config_json.encode()).hexdigest()[:16]
