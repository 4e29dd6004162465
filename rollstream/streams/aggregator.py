"""Response aggregation + filters: a faust agent over ``responses.rewarded`` with one table keyed
by prompt_id. Decisions come from rollstream.filtering.prompt_state; this module only persists
state and emits what the effects say.

A table value is the PromptState (JSON) followed by the accepted responses' original bytes, so
one changelog record per response carries everything needed to rebuild the group after a
restart, and the emitted Group splices those bytes in without decoding them again.
"""

from __future__ import annotations

import json
import logging
import struct
import time
from collections import deque

import faust

from rollstream.config import RLVRConfig
from rollstream.filtering.prompt_state import (
    Decided, DuplicateResponse, PromptState, Replacement, ResponseAccepted, ResponseRejected, step,
)
from rollstream.schemas import REGISTRY
from rollstream.streams import names
from rollstream.streams.common import Emitter, derive_seed, make_app, raw_topic
from rollstream.streams.events import decided_group, prompt_outcome, replacement_request
from rollstream.topics import Topics

log = logging.getLogger(__name__)

DECIDED_TTL_S = 300.0  # closed transactions are kept this long: well beyond the 1 s commit interval
_U32 = struct.Struct("<I")


def pack_state(state: PromptState, responses: dict[str, bytes]) -> bytes:
    """Table value: u32 length + state JSON, then per accepted response u32 length + bytes, in
    the order of ``state.accepted``."""
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


def build_aggregator_app(config: RLVRConfig, bootstrap: str, store: str = "memory://") -> faust.App:
    topics = Topics(config.kafka.topic_prefix)
    partitions = config.kafka.partitions
    app = make_app(names.app_id(topics, names.AGGREGATOR_APP), bootstrap, partitions, store)
    filters = config.domain_filters()
    filter_json = {d: config.filter_config_json(d) for d in filters}
    filter_hash = {d: config.filter_config_hash(d) for d in filters}
    emit = Emitter(app, topics, "aggregator")
    rewarded = raw_topic(app, topics.responses_rewarded, partitions)
    table = app.Table(names.PROMPT_STATE_TABLE, default=None, partitions=partitions, key_type=bytes,
                      value_type=bytes, help="prompt_id -> PromptState + accepted RewardedResponse bytes")
    stats = {"duplicates": 0, "responses_rejected": 0, "decided": 0}
    closed_keys: dict[int, deque] = {}  # partition -> [(closed_at, key)], oldest first

    async def handle(event) -> None:
        record = await emit.decode_or_dead_letter(event, "RewardedResponse")
        if record is None:
            return
        response = record["response"]
        if response["domain"] not in filters:
            await emit.dead_letter(event, "invalid_event",
                                   f"unknown domain {response['domain']!r}; configured: {sorted(filters)}")
            return
        pid = response["prompt_id"]
        key = pid.encode()
        raw = table.get(key)
        state, stored = unpack_state(raw) if raw else (None, {})
        state, effects = step(state, record, filters[response["domain"]])
        changed = False
        for effect in effects:
            if isinstance(effect, ResponseAccepted):
                stored[str(effect.sample_index)] = event.value
                changed = True
            elif isinstance(effect, ResponseRejected):
                stats["responses_rejected"] += 1
                changed = True
            elif isinstance(effect, DuplicateResponse):
                stats["duplicates"] += 1
                log.info("duplicate response %s/%d ignored", pid, effect.sample_index)
            elif isinstance(effect, Replacement):
                request = replacement_request(response, effect, derive_seed(config.seed, pid, effect.round))
                await emit.send(topics.generation_requests, pid, request, "GenerationRequest")
            elif isinstance(effect, Decided):
                await emit_decision(pid, response, effect, stored)
                closed_keys.setdefault(event.message.partition, deque()).append((time.monotonic(), key))
        if changed:
            table[key] = pack_state(state, stored)
        expired = closed_keys.get(event.message.partition)
        while expired and time.monotonic() - expired[0][0] > DECIDED_TTL_S:
            table.pop(expired.popleft()[1], None)

    async def emit_decision(pid: str, response: dict, decided: Decided, stored: dict[str, bytes]) -> None:
        domain = response["domain"]
        group = decided_group(response, decided, [], filter_json[domain], filter_hash[domain])
        value = REGISTRY.encode_with_tail_array(
            group, "Group", [stored[str(i)] for i in decided.sample_indices], "RewardedResponse")
        if response.get("mode", "train") == "val":
            topic = topics.groups_validation
        else:
            topic = topics.groups_accepted if decided.accepted else topics.groups_rejected
        await emit.send_raw(topic, pid, value)
        outcome = prompt_outcome(response, committed=decided.accepted, reason=decided.reason,
                                 rounds=decided.rounds, responses_generated=decided.responses_generated)
        await emit.send(topics.prompt_outcomes, pid, outcome, "PromptOutcome")
        stats["decided"] += 1

    @app.agent(rewarded)
    async def aggregate(stream):
        async for event in stream.events():
            await emit.guarded(handle, event)

    app.rollstream_stats = stats  # read by benchmarks that run the app in-process
    return app
