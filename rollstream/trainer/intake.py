"""What the trainer lets into its buffer, as pure checks: a trainable group, a redelivered key,
a group grown too stale to train. ``rollstream.trainer.consumer.BatchBuilder`` acts on them."""

from __future__ import annotations

from collections import OrderedDict

from rollstream.filtering.decision import Decision
from rollstream.kafka.events import decode_expected
from rollstream.trainer.batch import check_group

DEDUP_WINDOW = 100_000
"""Group keys remembered to recognise redelivered groups (bounded, so memory stays flat)."""

ACCEPTED_SCHEMAS = ("Group", "TrajectoryGroup")
"""Record types the trainer trains on: RLVR groups and agentic trajectory groups."""


def trainable_group(value: bytes | None) -> tuple[dict, None] | tuple[None, tuple[str, str]]:
    """Decode an event of ``groups.accepted``: ``(group, None)`` for an accepted ``Group`` or
    ``TrajectoryGroup`` that passes ``check_group``, else ``(None, (reason, error))`` with the
    dead-letter reason (``undecodable``, ``unknown_schema`` or ``invalid_event``)."""
    _, record, problem = decode_expected(value, ACCEPTED_SCHEMAS)
    if problem is not None:
        return None, problem
    if not record["accepted"]:
        return None, ("invalid_event", f"group {record['group_key']!r} on the accepted topic is not accepted "
                                       f"(reason {record['reason']!r})")
    try:
        check_group(record)
    except ValueError as exc:
        return None, ("invalid_event", str(exc))
    return record, None


class RecentKeys:
    """The newest ``window`` group keys seen (the oldest forgotten first), to recognise
    redelivered groups in bounded memory."""

    def __init__(self, window: int = DEDUP_WINDOW) -> None:
        self.window = window
        self._keys: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key: str) -> None:
        """Remember ``key`` as the newest (again, if it was known)."""
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > self.window:
            self._keys.popitem(last=False)


def stale_rejection(group: dict, decision: Decision) -> dict:
    """The ``groups.rejected`` record of an accepted ``group`` the trainer may no longer train:
    not accepted, ``decision``'s reason, its values added to the group's ``decision_values``."""
    return {**group, "accepted": False, "reason": decision.reason,
            "decision_values": {**group.get("decision_values", {}), **decision.values}}
