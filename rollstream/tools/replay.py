"""`rollstream replay`: read any rollstream topic back as JSON lines or a table, selected by
offset range, time range, key and field predicates, optionally following it live or re-injecting
the selected events into another topic (e.g. a sandbox prefix, to re-run a stage on them).

The selection is pure (``Selection.matches``); ``replay`` is the Kafka shell around it.
Re-injected events keep their exact key and value bytes, so the re-run stage decodes what the
original stage decoded.

Decision events (``RewardedResponse``, ``Group``, ``TrajectorySummary``, ``TrajectoryGroup``)
name their token payloads by ``PayloadRef``; ``replay`` shows the references and reads nothing
else, unless asked with ``payloads=True`` (``rollstream replay --payloads``): then each page of
selected records has its references resolved with one ``PayloadFetcher.fetch`` and every member
shows its payload's token counts and text (``with_payloads``).
"""

from __future__ import annotations

import base64
import math
import operator
import re
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Iterator, Mapping

import numpy as np
from kafka import KafkaConsumer, TopicPartition

from rollstream.exceptions import DecodeError, TopicNotFound
from rollstream.kafka.clients import reader_consumer
from rollstream.kafka.cluster import Bootstrap
from rollstream.kafka.payloads import PayloadFetcher, RefKey, ref_key
from rollstream.schemas import decode
from rollstream.schemas.records import MEMBER_LISTS, is_payload_ref, payload_members, payload_refs

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
class Payload:
    """What a ``PayloadRef`` resolved to: the payload event's schema and decoded value, or
    ``error`` (expired by retention, past the log end, undecodable)."""

    schema: str | None
    value: dict | None
    error: str | None = None


@dataclass(frozen=True)
class Replayed:
    """A selected record; ``payloads`` (only when replay was asked for them): every
    ``PayloadRef`` its value names -> what it resolved to."""

    record: Record
    timestamp_ms: int
    payloads: Mapping[RefKey, Payload] | None = None

    def shown_value(self, full: bool = True) -> dict | None:
        """The decoded value, with payload figures per member when payloads were resolved
        (``with_payloads``)."""
        if self.payloads is None or self.record.value is None:
            return self.record.value
        return with_payloads(self.record.value, self.payloads, full=full)

    def to_json(self) -> dict:
        """One JSON line: topic, partition, offset, timestamp_ms, key (text), schema (null when
        undecodable) and value (numpy arrays as lists, bytes fields as base64 text); ``raw_b64``
        for undecodable. With resolved payloads every member carries the full payload record
        under ``payload`` and the reference under ``payload_ref`` (``with_payloads``)."""
        r = self.record
        out = {"topic": r.topic, "partition": r.partition, "offset": r.offset, "timestamp_ms": self.timestamp_ms,
               "key": None if r.key is None else r.key.decode("utf-8", "replace"), "schema": r.schema,
               "value": jsonable(self.shown_value(full=True))}
        if r.schema is None:
            out["raw_b64"] = base64.b64encode(r.raw).decode()
        return out


def jsonable(value: Any) -> Any:
    """Decoded Avro values as JSON: numpy arrays (packed token fields) -> lists, numpy scalars ->
    numbers, bytes -> base64 text; non-finite floats -> "NaN"/"Infinity"/"-Infinity"."""
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist())
    if isinstance(value, np.generic):
        return jsonable(value.item())
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode()
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


# -- payload references ---------------------------------------------------------------------

def payload_figures(schema: str | None, payload: Mapping) -> dict:
    """What a member shows of its payload: ``payload_tokens`` (Response: prompt and response
    tokens; Trajectory: first prompt, flattened response, model tokens, turns) and the text
    (Response: ``response_text``; Trajectory: ``response_texts``, one per turn)."""
    if schema == "Trajectory" or "turns" in payload:
        turns = payload.get("turns") or []
        mask = payload.get("response_mask")
        mask = np.zeros(0, np.uint8) if mask is None else np.asarray(mask)
        return {"payload_tokens": {"prompt": len(turns[0]["prompt_token_ids"]) if turns else 0,
                                   "response": int(mask.size), "model": int(mask.sum()), "turns": len(turns)},
                "response_texts": [t.get("response_text", "") for t in turns]}
    return {"payload_tokens": {"prompt": len(payload.get("prompt_token_ids", ())),
                               "response": len(payload.get("response_token_ids", ()))},
            "response_text": payload.get("response_text", "")}


def member_payload(member: Mapping, payloads: Mapping[RefKey, Payload] | None) -> tuple[Payload | None, str | None]:
    """What a member's ``payload`` is: (the Payload its reference resolved to in ``payloads``, None),
    or (None, why not: the fetch's error, or "not fetched"). An inline payload (events written
    before references) comes back as itself, schema unknown."""
    payload = member["payload"]
    if not is_payload_ref(payload):
        return Payload(None, payload), None
    found = (payloads or {}).get(ref_key(payload))
    if found is None or found.value is None:
        return None, found.error if found is not None else "not fetched"
    return found, None


def with_payloads(value: Mapping, payloads: Mapping[RefKey, Payload], full: bool = True) -> dict:
    """A copy of ``value`` in which every member naming a payload (``payload_members``) also
    carries ``payload_figures`` of it; ``full``: its ``payload`` is the payload record itself and
    the reference moves to ``payload_ref``. A reference that did not resolve gets
    ``payload_error`` instead (its ``payload`` stays the reference). Inline payloads (events
    written before references) are shown the same way."""
    def resolve(member: Mapping) -> dict:
        payload = member["payload"]
        out = dict(member)
        if not is_payload_ref(payload):
            out.update(payload_figures(None, payload))
            return out
        found, error = member_payload(member, payloads)
        if found is None:
            out["payload_error"] = error
            return out
        out.update(payload_figures(found.schema, found.value))
        if full:
            out["payload_ref"], out["payload"] = payload, found.value
        return out

    if isinstance(value.get("payload"), Mapping):
        return resolve(value)
    out = dict(value)
    for name in MEMBER_LISTS:
        if isinstance(value.get(name), list):
            out[name] = [resolve(m) if isinstance(m, Mapping) and isinstance(m.get("payload"), Mapping) else m
                         for m in value[name]]
    return out


def payload_digest(value: Mapping | None, width: int = 60) -> str:
    """One line per member of an event shown with payloads (``with_payloads``): its index
    (``sample_index`` / ``traj_index``), token counts and the start of its text."""
    lines = []
    for n, member in enumerate(payload_members(value)):
        inner = member.get("response") if isinstance(member.get("response"), Mapping) else member
        index = inner.get("sample_index", inner.get("traj_index", n))
        if "payload_error" in member:
            lines.append(f"#{index} payload unavailable: {member['payload_error']}")
            continue
        tokens = member.get("payload_tokens")
        if tokens is None:
            continue
        text = member.get("response_text")
        if text is None:
            text = " | ".join(member.get("response_texts") or [])
        text = text.replace("\n", "\\n")
        text = text if len(text) <= width else text[:width - 1] + "…"
        lines.append(f"#{index} " + " ".join(f"{k}={v}" for k, v in tokens.items()) + f" {text!r}")
    return "\n".join(lines)


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



def replay(bootstrap: Bootstrap, topic: str, selection: Selection, *, follow: bool = False,
           limit: int | None = None, should_stop: Callable[[], bool] = lambda: False,
           poll_timeout_ms: int = 200, idle_timeout_s: float | None = None,
           payloads: bool = False) -> Iterator[Replayed]:
    """The selected records of ``topic`` in offset order per partition, from the selection's
    start to the end offsets at call time, or on and on with ``follow`` (until ``limit``
    records or ``should_stop()``). Without ``follow``, ``idle_timeout_s`` gives up after that
    long without any record (an end offset never reached). ``payloads``: resolve the
    ``PayloadRef`` records the selected events name (``Replayed.payloads``), one
    ``PayloadFetcher.fetch`` per page of records (a poll's selection); without it no payload
    topic is read. Raises TopicNotFound, ValueError for a partition that does not exist or a
    ``limit`` below 1, PayloadFetchTimeout when payloads that exist are not read in time. The
    one topic-reading loop: rollstream.tools.readback.read_topic is this with an empty
    selection."""
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    consumer = reader_consumer(bootstrap)
    fetcher: PayloadFetcher | None = None
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
            page: list[Replayed] = []
            for tp, msgs in polled.items():
                for m in msgs:
                    if limit is not None and emitted + len(page) >= limit:
                        break
                    if not follow and m.offset >= stop_at[tp]:
                        continue
                    try:
                        schema, value = decode(m.value)
                    except DecodeError:
                        schema, value = None, None
                    if not selection.matches(m.partition, m.offset, m.timestamp, m.key, value):
                        continue
                    page.append(Replayed(Record(m.topic, m.partition, m.offset, m.key, schema, value, m.value),
                                         m.timestamp))
            if payloads and page:
                if fetcher is None:
                    fetcher = PayloadFetcher(bootstrap, client_id="rollstream-replay")
                page = _resolve(fetcher, page)
            for item in page:
                yield item
                emitted += 1
            if limit is not None and emitted >= limit:
                return
            if not follow:
                remaining = {tp for tp in remaining if consumer.position(tp) < stop_at[tp]}
            elif selection.until_ms is not None and time.time() * 1000 >= selection.until_ms:
                return
    finally:
        consumer.close()
        if fetcher is not None:
            fetcher.close()


def _resolve(fetcher: PayloadFetcher, page: list[Replayed]) -> list[Replayed]:
    """The page with every record's payload references resolved by one fetch."""
    refs = {ref_key(ref): ref for item in page for ref in payload_refs(item.record.value)}
    resolved: dict[RefKey, Payload] = {}
    if refs:
        # a reference to a topic or partition that does not exist (another cluster, a deleted
        # prefix) is reported, never looked up: a lookup could auto-create the topic
        existing = fetcher.consumer.topics()  # all topics' metadata: creates nothing
        for key in list(refs):
            topic, partition, _ = key
            partitions = fetcher.consumer.partitions_for_topic(topic) if topic in existing else None
            if not partitions or partition not in partitions:
                resolved[key] = Payload(None, None, f"{topic}[{partition}] does not exist")
                del refs[key]
    if refs:
        fetched = fetcher.fetch(list(refs.values()))
        for key, reason in fetched.expired.items():
            resolved[key] = Payload(None, None, reason)
        for key, raw in fetched.values.items():
            try:
                schema, value = decode(raw)
                resolved[key] = Payload(schema, value)
            except DecodeError as exc:
                resolved[key] = Payload(None, None, f"undecodable payload: {exc}")
    return [Replayed(item.record, item.timestamp_ms,
                     {ref_key(r): resolved[ref_key(r)] for r in payload_refs(item.record.value)})
            for item in page]


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
