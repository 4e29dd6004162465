"""What the aggregator does with its input events and with the passing of time, without faust:
the processor shape of rollstream.streams.processor over a Store keyed by prompt_id. The faust
agent (rollstream.streams.aggregator_agent), the benchmark and replay tools call the same code.

Inputs: ``responses.rewarded`` (each RewardedResponse steps its prompt's state machine,
rollstream.filtering.prompt_state) and ``generation.requests`` (each request gives its prompt's
open round a deadline). ``tick`` reissues or aborts the prompts of the worker's partitions whose
deadline passed (an in-memory index of deadlines, rebuilt from the store after a start or a
rebalance). A decided prompt's table value is deleted ``DECIDED_TTL_S`` after its decision (kept
that long to answer redeliveries).

A table value is the PromptState (JSON) followed by the accepted responses' original bytes, so
one changelog record carries everything needed to rebuild the group after a restart, and the
emitted Group splices those bytes in without decoding them again. Those bytes are
RewardedResponse events: summaries with a PayloadRef, a few hundred bytes whatever the
responses' lengths (the tokens stay on ``responses``).

Batches: the decoded state of each prompt an event changed is held in memory, and ``end_batch``
writes each changed prompt's table value once (one changelog record per prompt and batch, not
per response: the stage's main cost). A table value read back is not decoded again when it is the
very object this processor wrote (object identity); any other value (a restart, a rebalance) is
decoded from its bytes. The lower-level calls (``apply``, ``request``, ``expire`` and
``table_value``) take and give table values; the store-level ones are built on them.
"""

from __future__ import annotations

import json
import logging
import struct
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Collection, Iterable

from kafka.partitioner.default import murmur2

from rollstream.config import RLVRConfig
from rollstream.exceptions import StageFault
from rollstream.filtering.prompt_state import (
    Decided,
    DuplicateResponse,
    PromptState,
    Reissue,
    Replacement,
    ResponseAccepted,
    ResponseRejected,
    on_request,
    on_tick,
    step,
    with_request,
)
from rollstream.kafka.events import Send, decode_expected
from rollstream.kafka.topics import Topics
from rollstream.observability.metrics import WorkerMetrics, process_metrics
from rollstream.runtime import now_ms
from rollstream.schemas import REGISTRY, encode
from rollstream.schemas.codec import HEADER_LEN
from rollstream.streams.processor import Handled
from rollstream.streams.event_builders import decided_group, derive_seed, prompt_outcome, replacement_request
from rollstream.streams.store import MemoryStore, Store

log = logging.getLogger(__name__)

_U32 = struct.Struct("<I")
DECIDED_TTL_S = 300.0  # decided prompts' values are kept this long: well beyond the 1 s commit interval


def count_effects(metrics: WorkerMetrics, effects: Iterable, mode: str) -> None:
    """Count one prompt's effects (rollstream.filtering.prompt_state) in ``metrics``: response and
    query decisions by reason, replacement rounds, rewards of all vs accepted groups, and the
    validation groups (``mode`` "val")."""
    for effect in effects:
        if isinstance(effect, ResponseAccepted):
            metrics.decision("response", True, "accepted")
        elif isinstance(effect, ResponseRejected):
            metrics.decision("response", False, effect.reason)
        elif isinstance(effect, Replacement):
            metrics.replacement_rounds.inc()
        elif isinstance(effect, Decided):
            metrics.version_rewards(mode, effect.policy_version, effect.rewards)
            if mode == "val":
                metrics.validation.labels("original").inc()
                metrics.validation.labels("accepted" if effect.accepted else "rejected").inc()
                continue
            metrics.decision("query", effect.accepted, effect.reason)
            metrics.rewards("all", effect.rewards)
            if effect.accepted:
                metrics.rewards("accepted", effect.rewards)


def pack_state(state: PromptState, responses: dict[str, bytes]) -> bytes:
    """u32 length + state JSON, then per accepted response u32 length + bytes, in the order of
    ``state.accepted``."""
    header = json.dumps(state.to_dict()).encode()
    parts = [_U32.pack(len(header)), header]
    for index in state.accepted:
        parts += [_U32.pack(len(responses[index])), responses[index]]
    return b"".join(parts)


def unpack_state(value: bytes) -> tuple[PromptState, dict[str, bytes]]:
    (n,) = _U32.unpack_from(value, 0)
    state = PromptState.from_dict(json.loads(value[4:4 + n]))
    responses, pos = {}, 4 + n
    for index in state.accepted:
        (size,) = _U32.unpack_from(value, pos)
        responses[index] = value[pos + 4:pos + 4 + size]
        pos += 4 + size
    return state, responses


def member_bytes(record: dict, event_value: bytes) -> bytes:
    """What the table keeps, and the Group lists, for an accepted RewardedResponse: the event
    without its prompt text, ground truth and chat messages, which the Group carries once. So a
    member's size depends neither on the response's length (the tokens are referenced) nor on the
    prompt's.

    An event of the current schema is cut at the byte level (two Avro strings and an array of
    ChatMessage near its start, each length- or count-prefixed: they become the single bytes of
    two empty strings and an empty array); an older writer's event is re-encoded."""
    summary = record["response"]
    if not summary.get("prompt") and not summary.get("ground_truth") and not summary.get("messages"):
        return event_value
    if event_value[2:HEADER_LEN] == _REWARDED_FP:
        start = HEADER_LEN
        for _ in range(_BEFORE_PROMPT):
            start = _after_string(event_value, start)
        end = _after_messages(event_value, _after_string(event_value, _after_string(event_value, start)))
        return event_value[:start] + b"\x00\x00\x00" + event_value[end:]
    return encode({**record, "response": {**summary, "prompt": "", "ground_truth": "", "messages": []}},
                  "RewardedResponse")


def _read_long(data: bytes, pos: int) -> tuple[int, int]:
    """The Avro long (zig-zag varint) at ``pos`` and the offset just after it."""
    shift = n = 0
    while True:
        byte = data[pos]
        pos += 1
        n |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return (n >> 1) ^ -(n & 1), pos


def _after_string(data: bytes, pos: int) -> int:
    """The offset just after the Avro string (long length, then bytes) at ``pos``."""
    size, pos = _read_long(data, pos)
    return pos + size


def _after_messages(data: bytes, pos: int) -> int:
    """The offset just after the Avro array of ChatMessage (blocks of a long count, then items of
    two strings; a negative count is followed by the block's byte size; count 0 ends) at ``pos``."""
    while True:
        count, pos = _read_long(data, pos)
        if count == 0:
            return pos
        if count < 0:
            size, pos = _read_long(data, pos)
            pos += size
            continue
        for _ in range(count):
            pos = _after_string(data, _after_string(data, pos))


_REWARDED_FP = REGISTRY.fingerprint("RewardedResponse")
_SUMMARY_HEAD = [(f["name"], f["type"] if isinstance(f["type"], str) else f["type"]["type"])
                 for f in REGISTRY.schema("ResponseSummary")["fields"][:6]]
_MESSAGE_FIELDS = [(f["name"], f["type"]) for f in REGISTRY.schema("ChatMessage")["fields"]]
_BEFORE_PROMPT = 3
if (REGISTRY.schema("RewardedResponse")["fields"][0]["name"] != "response"
        or _SUMMARY_HEAD != [("prompt_id", "string"), ("domain", "string"), ("mode", "string"), ("prompt", "string"),
                             ("ground_truth", "string"), ("messages", "array")]
        or _MESSAGE_FIELDS != [("role", "string"), ("content", "string")]):
    raise RuntimeError(f"member_bytes expects RewardedResponse to start with response: ResponseSummary whose first "
                       f"fields are the strings prompt_id, domain, mode, prompt, ground_truth, then messages: "
                       f"array<ChatMessage{{role, content: string}}>; got {_SUMMARY_HEAD}, {_MESSAGE_FIELDS}")


def prompt_partition(prompt_id: str, partitions: int) -> int:
    """The partition of ``prompt_id``'s events on the keyed topics (Kafka's default
    partitioner: murmur2 of the key, as every producer of them uses)."""
    return (murmur2(prompt_id.encode()) & 0x7FFFFFFF) % partitions


def _prompt_fields(state: PromptState, prompt_id: str) -> dict:
    """The prompt's fields for its Group and PromptOutcome when no response is at hand: its
    request's (prompt text, ground truth, chat messages), else only the identity."""
    base = {"prompt_id": prompt_id, "domain": state.domain, "mode": state.mode, "prompt": "",
            "ground_truth": "", "messages": []}
    return {**base, **{k: v for k, v in (state.request or {}).items() if k in base}}


@dataclass
class Applied:
    changed: bool = False  # the prompt's table value changed: write AggregatorProcessor.table_value(prompt_id)
    sends: list[Send] = field(default_factory=list)
    decided: Decided | None = None
    duplicates: int = 0
    effects: list = field(default_factory=list)  # the state machine's effects, for metrics
    mode: str = "train"  # the prompt's mode (train | val), for metrics


@dataclass
class _Held:
    """A prompt's decoded state; ``value``: the table value it was packed into, None while it has
    changes not yet packed."""

    value: bytes | None
    state: PromptState
    stored: dict[str, bytes]


class UnwrittenStateLost(StageFault):
    """Applying an event failed for a prompt whose earlier changes were held in memory only (not
    yet written to the table): they cannot be recovered in this process. The caller must not
    acknowledge those events; the aggregator exits and reprocesses them from the table."""


class AggregatorProcessor:
    """The per-prompt transactions of one config over ``store`` (see the module doc).
    ``policy_version()`` returns the newest published policy version (None: unknown), for the
    staleness bound.

    Store level (the processor shape): ``handle`` each event, ``end_batch`` after a batch,
    ``tick`` now and then. Table-value level: ``apply``/``request``/``expire`` an event or a
    deadline against the prompt's current table value (what the table holds; the state held here
    when it is newer), then, for every prompt whose ``Applied.changed`` was True, write
    ``table_value(prompt_id)``. Decided prompts are dropped from memory once their final value
    was taken.
    """

    def __init__(self, config: RLVRConfig, store: Store | None = None,
                 policy_version: Callable[[], int | None] = lambda: None) -> None:
        self.topics = Topics(config.kafka.topic_prefix)
        self.seed = config.seed
        self.prompt_timeout_s = config.prompt_timeout_s
        self.filters = config.domain_filters()
        self.filter_json = {d: config.filter_config_json(d) for d in self.filters}
        self.filter_hash = {d: config.filter_config_hash(d) for d in self.filters}
        self._held: dict[str, _Held] = {}  # prompt_id -> its decoded state
        self.state_decodes = 0  # table values decoded from bytes (not held in memory)
        self.deadlines: dict[str, int] = {}  # prompt_id -> its open round's deadline (epoch ms)
        self.partitions = config.kafka.partitions
        self.store = MemoryStore() if store is None else store
        self.policy_version = policy_version
        self.metrics = process_metrics()
        self._changed: dict[bytes, int] = {}  # key -> partition: prompts changed in this batch
        self._owned: set[int] = set()  # partitions of this batch's events and ticks: this worker's
        self._closed: dict[int, deque] = {}  # partition -> [(closed at, monotonic s; key)], oldest first
        self._reindex = True  # the deadline index is rebuilt from the store before the next tick

    # -- the processor shape ------------------------------------------------------------------

    def handle(self, topic: str, partition: int, value: bytes, now: int | None = None, *, offset: int) -> Handled:
        """One event read from ``topic`` at ``partition`` (``offset`` is not used: responses
        have identities of their own). Bad input comes back as ``Handled.error``. Raises
        UnwrittenStateLost (the process must exit) when an event fails for a prompt with
        changes held back in this batch."""
        if topic == self.topics.generation_requests:
            return self._request_event(partition, value, now)
        if topic != self.topics.responses_rewarded:
            return Handled(error=("invalid_event", f"{topic} is not an input of the aggregator"))
        _, record, problem = decode_expected(value, ("RewardedResponse",))
        if problem is not None:
            return Handled(error=problem)
        response = record["response"]
        if response["domain"] not in self.filters:
            return Handled(error=("invalid_event", f"unknown domain {response['domain']!r}; configured: "
                                                   f"{sorted(self.filters)}"))
        key = response["prompt_id"].encode()
        self._owned.add(partition)
        applied = self.apply(self.store.get(key), value, record, self.policy_version(), now)
        count_effects(self.metrics, applied.effects, response.get("mode", "train"))
        self._after(key, partition, applied)
        return Handled(sends=applied.sends, log=[f"redelivered response of {key.decode()} ignored"]
                       if applied.duplicates else [])

    def _request_event(self, partition: int, value: bytes, now: int | None) -> Handled:
        """A GenerationRequest: its prompt's open round gets a deadline. An undecodable request or
        one of an unknown domain is skipped: the generation worker, its consumer, dead-letters
        it (a second dead letter would count it twice)."""
        _, record, problem = decode_expected(value, ("GenerationRequest",))
        if problem is not None or record["domain"] not in self.filters:
            return Handled()
        key = record["prompt_id"].encode()
        self._after(key, partition, self.request(self.store.get(key), record, now))
        return Handled()

    def tick(self, partitions: Collection[int], now: int | None = None) -> Handled:
        """Reissue or abort the prompts of ``partitions`` (those this worker owns) whose deadline
        passed by ``now`` (epoch ms, default the clock); rebuilds the deadline index from the store
        first after a start or :meth:`assigned`."""
        now = now_ms() if now is None else now
        out = Handled()
        self._owned.update(partitions)
        if self._reindex:
            self._reindex = False
            indexed = self.index((k, v) for k, v in self.store.items()
                                 if prompt_partition(k.decode(), self.partitions) in partitions)
            out.log.append(f"deadline index rebuilt: {indexed} prompts waiting in partitions {sorted(partitions)}")
        for pid in self.due(now):
            key, partition = pid.encode(), prompt_partition(pid, self.partitions)
            if partition not in partitions:  # revoked since it was indexed
                self.deadlines.pop(pid, None)
                continue
            applied = self.expire(pid, self.store.get(key), now)
            count_effects(self.metrics, applied.effects, applied.mode)
            for effect in applied.effects:
                log.warning("prompt %s past its deadline (prompt_timeout_s %.0f): %s", pid, self.prompt_timeout_s,
                            effect)
            self._after(key, partition, applied)
            out.sends += applied.sends
        return out

    def end_batch(self) -> None:
        """Write the table value of every prompt changed since the last call (once each), and
        delete the values of prompts decided more than ``DECIDED_TTL_S`` ago in the partitions
        this batch's events and ticks came from."""
        changed, self._changed = self._changed, {}
        for key, partition in changed.items():
            if self.unwritten(key.decode()):
                self.store.put(partition, key, self.table_value(key.decode()))
        expired = time.monotonic() - DECIDED_TTL_S
        owned, self._owned = self._owned, set()
        for partition in owned:  # never a partition revoked since: its changelog is another worker's now
            closed = self._closed.get(partition)
            while closed and closed[0][0] < expired:
                key = closed.popleft()[1]
                if self.store.get(key) is not None:
                    self.store.put(partition, key, None)
        self.store.flush()

    def assigned(self) -> None:
        self._reindex = True

    def _after(self, key: bytes, partition: int, applied: Applied) -> None:
        if applied.changed:
            self._changed[key] = partition
        if applied.decided is not None:
            self._closed.setdefault(partition, deque()).append((time.monotonic(), key))

    # -- table values -------------------------------------------------------------------------

    def apply(self, table_value: bytes | None, event_value: bytes, record: dict,
              current_version: int | None = None, now: int | None = None) -> Applied:
        """One decoded RewardedResponse ``record`` (``event_value`` its bytes) against the prompt's
        table value; ``current_version``: the newest published policy version, for the staleness
        bound; ``now``: epoch ms (default: the clock), when a replacement round's deadline starts.
        The caller checked that the record's domain is configured."""
        response = record["response"]
        filters = self.filters[response["domain"]]
        now = now_ms() if now is None else now

        def transition(state: PromptState | None, stored: dict[str, bytes], out: Applied) -> PromptState:
            state, effects = step(state, record, filters, current_version)
            out.effects = effects
            for effect in effects:
                if isinstance(effect, ResponseAccepted):
                    stored[str(effect.sample_index)] = member_bytes(record, event_value)
                    out.changed = True
                elif isinstance(effect, ResponseRejected):
                    out.changed = True  # its counters live in the state
                elif isinstance(effect, DuplicateResponse):
                    out.duplicates += 1
                elif isinstance(effect, Replacement):
                    pid = response["prompt_id"]
                    request = replacement_request(response, effect, derive_seed(self.seed, pid, effect.round))
                    state = with_request(state, request, filters, now)
                    out.sends.append(Send(self.topics.generation_requests, pid, encode(request, "GenerationRequest")))
                elif isinstance(effect, Decided):
                    out.decided = effect
                    out.sends += self._decision(response, effect, stored)
            return state

        return self._transact(response["prompt_id"], table_value, transition)

    def request(self, table_value: bytes | None, record: dict, now: int | None = None) -> Applied:
        """A GenerationRequest ``record`` seen on ``generation.requests``: the open round's
        request is kept with its deadline (rollstream.filtering.prompt_state.on_request). The
        caller checked that the record's domain is configured."""
        filters = self.filters[record["domain"]]
        now = now_ms() if now is None else now

        def transition(state: PromptState | None, stored: dict[str, bytes], out: Applied) -> PromptState | None:
            state, out.changed = on_request(state, record, filters, now)
            return state

        return self._transact(record["prompt_id"], table_value, transition)

    def expire(self, prompt_id: str, table_value: bytes | None, now: int | None = None) -> Applied:
        """Check ``prompt_id``'s deadline at ``now`` (epoch ms, default the clock): reissue its
        open round's request (to the partition ``reissue`` places away from the prompt's own, so
        a stuck generation worker's requests reach another one) or abort it ``prompt_timeout``."""
        now = now_ms() if now is None else now

        def transition(state: PromptState | None, stored: dict[str, bytes], out: Applied) -> PromptState | None:
            if state is None:
                return None
            out.mode, prompt = state.mode, _prompt_fields(state, prompt_id)  # before a decision closes it
            state, out.effects = on_tick(state, self.filters[state.domain], now)
            for effect in out.effects:
                out.changed = True
                if isinstance(effect, Reissue):
                    request = {**effect.request, "created_ms": now}
                    partition = (prompt_partition(prompt_id, self.partitions) + effect.reissue) % self.partitions
                    out.sends.append(Send(self.topics.generation_requests, prompt_id,
                                          encode(request, "GenerationRequest"), partition))
                elif isinstance(effect, Decided):
                    out.decided = effect
                    out.sends += self._decision(prompt, effect, stored)
            return state

        return self._transact(prompt_id, table_value, transition)

    def due(self, now: int | None = None) -> list[str]:
        """The prompts whose open round's deadline has passed, oldest deadline first."""
        now = now_ms() if now is None else now
        return sorted((p for p, d in self.deadlines.items() if d <= now), key=self.deadlines.__getitem__)

    def index(self, items) -> int:
        """Rebuild the deadline index from ``items``: (key, table value) pairs of the partitions
        this worker owns (after a restart or a rebalance). Returns the prompts indexed."""
        self.deadlines.clear()
        for key, value in items:
            if value:
                state, _ = unpack_state(value)
                if state.decided is None and state.deadline_ms:
                    self.deadlines[key.decode()] = state.deadline_ms
        return len(self.deadlines)

    def _transact(self, pid: str, table_value: bytes | None, transition) -> Applied:
        """Run ``transition(state, stored, out)`` on the newest state of ``pid`` (held, or decoded
        from ``table_value``) and keep the result held for ``table_value``."""
        held = self._held.pop(pid, None)  # put back below once this event is applied
        unwritten = held is not None and held.value is None
        if held is not None and (unwritten or held.value is table_value):
            state, stored = held.state, held.stored
        elif table_value:
            state, stored = unpack_state(table_value)
            self.state_decodes += 1
        else:
            state, stored = None, {}
        out = Applied()
        try:
            state = transition(state, stored, out)
        except Exception as exc:
            if unwritten:  # earlier events' changes were held here only, and step mutates in place
                raise UnwrittenStateLost(
                    f"prompt {pid}: applying an event failed ({type(exc).__name__}: {exc}); its changes not yet "
                    "written to the table are lost") from exc
            raise  # the table value is intact: the next event decodes it again
        if state is not None and state.decided is None and state.deadline_ms:
            self.deadlines[pid] = state.deadline_ms
        else:
            self.deadlines.pop(pid, None)
        if state is None:
            return out
        if out.changed:
            self._held[pid] = _Held(None, state, stored)
        elif held is not None and (unwritten or held.value is table_value):
            self._held[pid] = held  # nothing changed (a redelivery): still valid
        elif table_value and state.decided is None:
            self._held[pid] = _Held(table_value, state, stored)  # decoded, unchanged: keep it
        return out

    def unwritten(self, prompt_id: str) -> bool:
        """True when ``prompt_id`` has changes whose ``table_value`` was not taken yet."""
        held = self._held.get(prompt_id)
        return held is not None and held.value is None

    def table_value(self, prompt_id: str) -> bytes:
        """The table value of ``prompt_id`` after every event applied so far; the caller writes
        it. Raises KeyError for a prompt no applied event changed."""
        held = self._held[prompt_id]
        if held.value is None:
            held.value = pack_state(held.state, held.stored)
        if held.state.decided is not None:
            del self._held[prompt_id]  # closed: its value only answers redeliveries now
        return held.value

    def _decision(self, response: dict, decided: Decided, stored: dict[str, bytes]) -> list[Send]:
        pid, domain = response["prompt_id"], response["domain"]
        group = decided_group(response, decided, [], self.filter_json[domain], self.filter_hash[domain])
        value = REGISTRY.encode_with_tail_array(
            group, "Group", [stored[str(i)] for i in decided.sample_indices], "RewardedResponse")
        topic = self.topics.decision_topic(response.get("mode", "train"), decided.accepted)
        outcome = prompt_outcome(response, committed=decided.accepted, reason=decided.reason,
                                 rounds=decided.rounds, responses_generated=decided.responses_generated,
                                 policy_version=decided.policy_version, rewards=decided.rewards)
        return [Send(topic, pid, value), Send(self.topics.prompt_outcomes, pid, encode(outcome, "PromptOutcome"))]
