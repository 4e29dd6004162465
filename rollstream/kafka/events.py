"""What a stage reads and writes: a decoded ``Input``, an ``Output`` record to encode, an already
encoded ``Send``; decoding an expected event; the one dead-letter event builder; the size guard
every producer applies (``guard_size``) and a payload that must fit ``kafka.max_message_bytes``
(``fit``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from rollstream.exceptions import DecodeError, UnknownFingerprintError
from rollstream.kafka.topics import Topics
from rollstream.runtime import now_ms
from rollstream.schemas import decode, encode
from rollstream.schemas.validation import check_event

log = logging.getLogger(__name__)

TOO_LARGE = "too_large"
"""Dead-letter reason of an event above ``kafka.max_message_bytes``, and the prefix of the
``error`` of the stand-in a worker sends in its place (``fit``)."""


@dataclass(frozen=True)
class Output:
    """One event to produce: schema ``schema`` encoded on ``topic`` under ``key``."""

    topic: str
    key: str
    schema: str
    record: dict


@dataclass(frozen=True)
class Input:
    """A decoded input event and where it came from."""

    schema: str
    record: dict
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes


@dataclass(frozen=True)
class Send:
    """One already encoded event to produce (``partition`` None: by key)."""

    topic: str
    key: str
    value: bytes
    partition: int | None = None


class SourceRecord(Protocol):
    """Where an event was read: kafka-python's ConsumerRecord, ``Input`` and faust's Message all
    have these attributes."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None


def decode_expected(value: bytes | None, expected: Sequence[str], where: str = ""
                    ) -> tuple[str, dict, None] | tuple[None, None, tuple[str, str]]:
    """Decode an event that must be one of the ``expected`` schemas.

    Returns ``(schema, record, None)``, or ``(None, None, (reason, error))`` with the dead-letter
    reason every stage uses: ``unknown_schema`` (a fingerprint no schema here has),
    ``undecodable`` (not a single-object Avro event) or ``invalid_event`` (another schema, or a
    record rollstream.schemas.validation.check_event refuses; ``where`` is added to the message,
    e.g. " on <topic>").
    """
    try:
        schema, record = decode(value or b"")
    except UnknownFingerprintError as exc:
        return None, None, ("unknown_schema", str(exc))
    except DecodeError as exc:
        return None, None, ("undecodable", str(exc))
    if schema not in expected:
        return None, None, ("invalid_event", f"expected {' or '.join(expected)}{where}, got {schema}")
    problem = check_event(schema, record)
    if problem is not None:
        return None, None, ("invalid_event", f"{schema}{where}: {problem}")
    return schema, record, None


def too_large(topics: Topics, topic: str, key: str, schema: str, size: int, limit: int, worker: str) -> Output:
    """The dead-letter event of a ``schema`` event for ``topic`` that is ``size`` bytes, above
    ``kafka.max_message_bytes`` = ``limit``: reason ``too_large``; the bytes are not kept (they
    would not fit either), partition and offset are -1 (it was never written)."""
    return Output(
        topic=topics.dead_letter, key=topic, schema="DeadLetter",
        record={
            "source_topic": topic, "partition": -1, "offset": -1, "key": key.encode(), "payload": b"",
            "reason": TOO_LARGE,
            "error": f"{schema} for {topic} (key {key!r}) is {size} bytes, above kafka.max_message_bytes = {limit}; "
                     f"raise kafka.max_message_bytes (the payload topics' max.message.bytes) to carry it",
            "worker": worker, "created_ms": now_ms(),
        },
    )


def guard_size(topics: Topics, send: Send, schema: str, limit: int, worker: str) -> tuple[Send, bool]:
    """The size guard every producer applies: ``send`` (an encoded ``schema`` event, or "event")
    when its value is at most ``limit`` bytes (``kafka.max_message_bytes``), else its ``too_large``
    dead letter, encoded; and whether it was replaced. No worker dies of a size."""
    if len(send.value) <= limit:
        return send, False
    log.warning("%s for %s is %d bytes, above max_message_bytes %d: dead-lettered too_large",
                schema, send.topic, len(send.value), limit)
    dl = too_large(topics, send.topic, send.key, schema, len(send.value), limit, worker)
    return Send(dl.topic, dl.key, encode(dl.record, dl.schema)), True


def fit(topics: Topics, topic: str, key: str, schema: str, record: dict, limit: int, worker: str,
        stand_in: Callable[[dict, int], dict]) -> tuple[dict, list[Output | Send]]:
    """``record`` (of ``schema``) encoded once as a ``Send`` on ``topic``; when it is ``size`` bytes,
    above ``limit`` (``kafka.max_message_bytes``), ``stand_in(record, size)`` instead (the same
    identity without the payload, so whatever waits for it moves on; see ``too_large_error``) and
    the record's ``too_large`` dead letter. Returns the record sent and the outputs. Raises
    EncodeError when a record does not encode."""
    value = encode(record, schema)
    if len(value) <= limit:
        return record, [Send(topic, key, value)]
    replacement = stand_in(record, len(value))
    return replacement, [Send(topic, key, encode(replacement, schema)),
                         too_large(topics, topic, key, schema, len(value), limit, worker)]


def too_large_error(schema: str, size: int, limit: int, detail: str) -> str:
    """The ``error`` of a stand-in for a ``schema`` event of ``size`` bytes above ``limit``:
    ``too_large: ...`` naming the size, the setting and ``detail`` (what made it large)."""
    return (f"{TOO_LARGE}: {schema} is {size} bytes, above kafka.max_message_bytes = {limit} ({detail}); "
            "raise kafka.max_message_bytes to carry it")


def dead_letter(topics: Topics, source: SourceRecord, reason: str, error: str, worker: str) -> Output:
    """The dead-letter event of ``source``: its original key and bytes, and why (``reason`` one of
    ``undecodable``, ``unknown_schema``, ``invalid_event``, ``handler_error``, ...; ``error`` the
    message, cut at 2,000 characters). Keyed by the source topic."""
    return Output(
        topic=topics.dead_letter,
        key=source.topic,
        schema="DeadLetter",
        record={
            "source_topic": source.topic, "partition": source.partition, "offset": source.offset,
            "key": source.key, "payload": source.value or b"", "reason": reason, "error": error[:2000],
            "worker": worker, "created_ms": now_ms(),
        },
    )
