"""`rollstream replay`: read any rollstream topic back as JSON lines or a table, selected by
offset range, time range, key and field predicates, optionally following it live or re-injecting
the selected events into another topic (e.g. a sandbox prefix, to re-run a stage on them).

The selection is pure (``Selection.matches``); ``replay`` is the Kafka shell around it.
Re-injected events keep their exact key and value bytes, so the re-run stage decodes what the
original stage decoded.
"""

from __future__ import annotations

import base64
import math
import operator
import re
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Iterator

from kafka import KafkaConsumer, TopicPartition

from rollstream.exceptions import DecodeError, TopicNotFound
from rollstream.kafka.clients import reader_consumer
from rollstream.schemas import decode

_OPS: dict[str, Callable[[Any, Any], bool]] = {
    "!=": operator.ne, ">=": operator.ge, "<=": operator.le, "=": operator.eq, ">": operator.gt, "<": operator.lt,
}
_PREDICATE = re.compile(r"^([A-Za-z_][\w./@-]*?)\s*(!=|>=|<=|=|>|<)\s*(.*)$")


@dataclass(frozen=True)
class Record:
    """One record read back: where it was, its schema and decoded value (None when undecodable)
    and its original bytes."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    schema: str | None  # None when undecodable
    value: dict | None
    raw: bytes


@dataclass(frozen=True)
class Predicate:
    """``path op value``: ``path`` is a dotted field path into the decoded event (``reason``,
    ``response.domain``, ``decision_values.std``); ``=``/``!=`` compare as numbers when both
    sides are numbers, else as text (booleans as ``true``/``false``); ``<``, ``<=``, ``>``,
    ``>=`` compare numbers only. A missing field never matches."""

    path: tuple[str, ...]
    op: str
    value: str

    @classmethod
    def parse(cls, text: str) -> "Predicate":
        """Raises ValueError naming the accepted form."""
        m = _PREDICATE.match(text.strip())
        if not m:
            raise ValueError(f"bad predicate {text!r}: expected FIELD=VALUE (or != >= <= > <), "
                             "e.g. reason=zero_std or response.domain=gsm8k")
        path, op, value = m.groups()
        if op in ("<", "<=", ">", ">=") and _number(value) is None:
            raise ValueError(f"bad predicate {text!r}: {op} needs a number")
        return cls(tuple(path.split(".")), op, value)

    def matches(self, record: Any) -> bool:
        found, actual = _lookup(record, self.path)
        if not found:
            return False
        want_n, have_n = _number(self.value), _number(actual)
        if want_n is not None and have_n is not None:
            return _OPS[self.op](have_n, want_n)
        if self.op not in ("=", "!="):
            return False
        want = self.value.lower() if isinstance(actual, bool) else self.value  # true/True/TRUE
        return _OPS[self.op](_text(actual), want)


def _lookup(record: Any, path: tuple[str, ...]) -> tuple[bool, Any]:
    node = record
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return str(value)


@dataclass(frozen=True)
class Selection:
    """Which records of a topic to show. Offsets are inclusive-exclusive per partition
    (``from_offset`` <= offset < ``to_offset``); times are record timestamps in ms,
    ``since_ms`` <= t < ``until_ms``; ``key`` matches the record key as UTF-8 text;
    ``partitions`` None = all. Undecodable records match only when no predicate is given."""

    from_offset: int | None = None
    to_offset: int | None = None
    since_ms: int | None = None
    until_ms: int | None = None
    key: str | None = None
    partitions: tuple[int, ...] | None = None
    predicates: tuple[Predicate, ...] = field(default_factory=tuple)

    def matches(self, partition: int, offset: int, timestamp_ms: int, key: bytes | None, value: dict | None) -> bool:
        if self.partitions is not None and partition not in self.partitions:
            return False
        if self.from_offset is not None and offset < self.from_offset:
            return False
        if self.to_offset is not None and offset >= self.to_offset:
            return False
        if self.since_ms is not None and timestamp_ms < self.since_ms:
            return False
        if self.until_ms is not None and timestamp_ms >= self.until_ms:
            return False
        if self.key is not None and (key is None or key.decode("utf-8", "replace") != self.key):
            return False
        if value is None:
            return not self.predicates
        return all(p.matches(value) for p in self.predicates)


@dataclass(frozen=True)
class Replayed:
    record: Record
    timestamp_ms: int

    def to_json(self) -> dict:
        """One JSON line: topic, partition, offset, timestamp_ms, key (text), schema (null when
        undecodable) and value (bytes fields as base64 text); ``raw_b64`` for undecodable."""
        r = self.record
        out = {"topic": r.topic, "partition": r.partition, "offset": r.offset, "timestamp_ms": self.timestamp_ms,
               "key": None if r.key is None else r.key.decode("utf-8", "replace"), "schema": r.schema,
               "value": jsonable(r.value)}
        if r.schema is None:
            out["raw_b64"] = base64.b64encode(r.raw).decode()
        return out


def jsonable(value: Any) -> Any:
    """Decoded Avro values as JSON: bytes -> base64 text; non-finite floats -> "NaN"/"Infinity"."""
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [jsonable(v) for v in value]
    return value


# shown first in the table view: why and what, before identities
_FIRST = ("reason", "accepted", "domain", "mode", "finish_reason", "response_level_reward", "name", "value", "status")


def summary(value: dict | None, width: int = 160) -> str:
    """A one-line digest of an event for the table view: the decision fields first (reason,
    accepted, domain, ...), then ``decision_values``, then the other scalar top-level fields."""
    if value is None:
        return "(undecodable)"
    scalars = {k: v for k, v in value.items() if isinstance(v, (str, int, float, bool)) and v != ""}
    parts = [f"{k}={_text(scalars.pop(k))}" for k in _FIRST if k in scalars]
    decision = value.get("decision_values")
    if isinstance(decision, dict) and decision:
        parts.append("values{" + ", ".join(f"{k}={_text(round(v, 4) if isinstance(v, float) else v)}"
                                            for k, v in decision.items()) + "}")
    parts += [f"{k}={_text(v)}" for k, v in scalars.items()]
    text = " ".join(parts)
    return text if len(text) <= width else text[:width - 1] + "…"


def parse_time_ms(text: str) -> int:
    """Milliseconds since the epoch, or an ISO 8601 time (UTC when no zone is given). Raises
    ValueError."""
    if text.strip().lstrip("-").isdigit():
        return int(text)
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"bad time {text!r}: give milliseconds since the epoch or ISO 8601 "
                         "(e.g. 2026-11-29T23:00:00)") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return int(moment.timestamp() * 1000)



def replay(bootstrap: str, topic: str, selection: Selection, *, follow: bool = False,
           limit: int | None = None, should_stop: Callable[[], bool] = lambda: False,
           poll_timeout_ms: int = 200, idle_timeout_s: float | None = None) -> Iterator[Replayed]:
    """The selected records of ``topic`` in offset order per partition, from the selection's
    start to the end offsets at call time, or on and on with ``follow`` (until ``limit``
    records or ``should_stop()``). Without ``follow``, ``idle_timeout_s`` gives up after that
    long without any record (an end offset never reached). Raises TopicNotFound, ValueError for
    a partition that does not exist or a ``limit`` below 1. The one topic-reading loop:
    rollstream.tools.readback.read_topic is this with an empty selection."""
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    consumer = reader_consumer(bootstrap)
    try:
        partitions = consumer.partitions_for_topic(topic)
        if not partitions:
            raise TopicNotFound(f"topic {topic!r} does not exist")
        missing = sorted(set(selection.partitions or ()) - partitions)
        if missing:
            raise ValueError(f"topic {topic!r} has no partition {missing}; it has {sorted(partitions)}")
        tps = [TopicPartition(topic, p) for p in sorted(partitions)
               if selection.partitions is None or p in selection.partitions]
        consumer.assign(tps)
        _seek_start(consumer, tps, selection)
        end = consumer.end_offsets(tps)
        stop_at = {tp: min(end[tp], selection.to_offset) if selection.to_offset is not None else end[tp] for tp in tps}
        remaining = {tp for tp in tps if consumer.position(tp) < stop_at[tp]}
        emitted, idle_since = 0, time.monotonic()
        while (follow or remaining) and not should_stop():
            polled = consumer.poll(timeout_ms=poll_timeout_ms)
            if polled:
                idle_since = time.monotonic()
            elif not follow and idle_timeout_s is not None and time.monotonic() - idle_since > idle_timeout_s:
                return
            for tp, msgs in polled.items():
                for m in msgs:
                    if not follow and m.offset >= stop_at[tp]:
                        continue
                    try:
                        schema, value = decode(m.value)
                    except DecodeError:
                        schema, value = None, None
                    if not selection.matches(m.partition, m.offset, m.timestamp, m.key, value):
                        continue
                    yield Replayed(Record(m.topic, m.partition, m.offset, m.key, schema, value, m.value), m.timestamp)
                    emitted += 1
                    if limit is not None and emitted >= limit:
                        return
            if not follow:
                remaining = {tp for tp in remaining if consumer.position(tp) < stop_at[tp]}
            elif selection.until_ms is not None and time.time() * 1000 >= selection.until_ms:
                return
    finally:
        consumer.close()


def _seek_start(consumer: KafkaConsumer, tps: list[TopicPartition], selection: Selection) -> None:
    consumer.seek_to_beginning(*tps)
    starts = {tp: consumer.position(tp) for tp in tps}
    if selection.since_ms is not None:
        found = consumer.offsets_for_times({tp: selection.since_ms for tp in tps})
        end = consumer.end_offsets(tps)
        for tp in tps:
            starts[tp] = found[tp].offset if found.get(tp) is not None else end[tp]
    if selection.from_offset is not None:
        starts = {tp: max(o, selection.from_offset) for tp, o in starts.items()}
    for tp, offset in starts.items():
        consumer.seek(tp, offset)
