"""What the trainer lets into its buffer and into a batch, as pure checks: a trainable group, a
redelivered key, a group grown too stale to train, the payloads a group names and their decoded
records. ``rollstream.trainer.batch_builder.BatchBuilder`` acts on them."""

from __future__ import annotations

from collections import OrderedDict
from typing import Mapping

from rollstream.exceptions import RollstreamError
from rollstream.filtering.decision import Decision
from rollstream.kafka.events import decode_expected
from rollstream.kafka.payloads import RefKey, ref_key
from rollstream.schemas import decode
from rollstream.schemas.records import group_rows, is_payload_ref, is_trajectory_group
from rollstream.trainer.batch import check_group

DEDUP_WINDOW = 100_000
"""Group keys remembered to recognise redelivered groups (bounded, so memory stays flat)."""

ACCEPTED_SCHEMAS = ("Group", "TrajectoryGroup")
"""Record types the trainer trains on: RLVR groups and agentic trajectory groups."""


def trainable_group(value: bytes | None) -> tuple[dict, None] | tuple[None, tuple[str, str]]:
    """Decode an event of ``groups.accepted``: ``(group, None)`` for an accepted ``Group`` or
    ``TrajectoryGroup`` that passes ``check_group`` (the summary checks; payloads are checked once
    fetched, see ``resolve_payloads``), else ``(None, (reason, error))`` with the dead-letter
    reason (``undecodable``, ``unknown_schema`` or ``invalid_event``)."""
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


def resolve_payloads(group: Mapping, values: Mapping[RefKey, bytes]) -> dict:
    """A copy of ``group`` in which every member's ``payload`` is the decoded record: the
    ``Response`` (``Group``) or ``Trajectory`` (``TrajectoryGroup``) whose bytes ``values`` holds
    under the reference's ``(topic, partition, offset)`` (``PayloadFetcher.fetch(...).values``);
    inline payloads are kept. ``group`` itself is not changed (its references stay, for the events
    that name the group again, e.g. a rejection).

    Raises:
        ValueError: a reference missing from ``values``, a payload that does not decode, is not
            the expected schema, or whose identity differs from the member's summary
            (``prompt_id``/``sample_index``; ``mode``/``group_id``/``episode_id``/``traj_index``).
    """
    trajectory = is_trajectory_group(group)
    expected = "Trajectory" if trajectory else "Response"
    key = group.get("group_key", "?")
    members = []
    for member in group_rows(group):
        payload = member["payload"]
        if is_payload_ref(payload):
            identity = _identity(member, trajectory, summary=True)
            where = f"group {key!r} member {identity}"
            topic, partition, offset = loc = ref_key(payload)
            at = f"{topic}[{partition}]@{offset}"
            if loc not in values:
                raise ValueError(f"{where}: payload {at} was not fetched")
            try:
                schema, payload = decode(values[loc])
            except RollstreamError as exc:
                raise ValueError(f"{where}: payload {at} does not decode: {exc}") from None
            if schema != expected:
                raise ValueError(f"{where}: payload {at} is a {schema}, expected a {expected}")
            found = _identity(payload, trajectory, summary=False)
            if found != identity:
                raise ValueError(f"{where}: payload {at} is the {expected} of {found}, not of this member")
        members.append({**member, "payload": payload})
    return {**group, ("trajectories" if trajectory else "responses"): members}


def _identity(record: Mapping, trajectory: bool, summary: bool) -> tuple:
    """What names one payload: ``(prompt_id, sample_index)`` of a response (a summary's under
    its ``response``), ``(mode, group_id, episode_id, traj_index)`` of a trajectory."""
    if trajectory:
        return (record.get("mode", "train"), record["group_id"], record["episode_id"], record["traj_index"])
    fields = record["response"] if summary else record
    return (fields["prompt_id"], fields["sample_index"])


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
    """The ``groups.rejected`` record of an accepted ``group`` the trainer may no longer train
    (``stale``, or ``payload_expired``): not accepted, ``decision``'s reason, its values added to
    the group's ``decision_values``. ``group`` should be the event as consumed (members naming
    their payloads by reference), so the rejection stays a small decision event."""
    return {**group, "accepted": False, "reason": decision.reason,
            "decision_values": {**group.get("decision_values", {}), **decision.values}}
