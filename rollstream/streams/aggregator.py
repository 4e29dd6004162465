"""Response aggregation + filters: faust agent over ``responses.rewarded``, tables keyed by
prompt_id. Decisions come from rollstream.filtering.prompt_state; this module only persists
state and emits what the effects say."""

from __future__ import annotations

import json
import logging
import time
from collections import deque

import faust

from rollstream.config import RLVRConfig
from rollstream.filtering.prompt_state import (
    Decided, DuplicateResponse, PromptState, Replacement, ResponseAccepted, ResponseRejected, step,
)
from rollstream.schemas import decode
from rollstream.streams import names
from rollstream.streams.common import Emitter, derive_seed, make_app, raw_topic
from rollstream.streams.events import decided_group, prompt_outcome, replacement_request
from rollstream.topics import Topics

log = logging.getLogger(__name__)

DECIDED_TTL_S = 300.0  # well beyond the 1 s commit interval


def build_aggregator_app(config: RLVRConfig, bootstrap: str, store: str = "memory://") -> faust.App:
    topics = Topics(config.kafka.topic_prefix)
    partitions = config.kafka.partitions
    app = make_app(names.app_id(topics, names.AGGREGATOR_APP), bootstrap, partitions, store)
    filters = config.domain_filters()
    filter_json = {d: config.filter_config_json(d) for d in filters}
    filter_hash = {d: config.filter_config_hash(d) for d in filters}
    emit = Emitter(app, topics, "aggregator")
    rewarded = raw_topic(app, topics.responses_rewarded, partitions)
    state_table = app.Table(names.PROMPT_STATE_TABLE, default=None, partitions=partitions,
                            key_type=bytes, value_type=bytes, help="prompt_id -> open PromptState (JSON)")
    responses_table = app.Table(names.PROMPT_RESPONSES_TABLE, default=None, partitions=partitions,
                                key_type=bytes, value_type=bytes,
                                help="prompt_id/sample_index -> accepted RewardedResponse (Avro bytes)")
    stats = {"duplicates": 0, "responses_rejected": 0, "decided": 0}
    # partition -> [(decided_at, key)]: closed transactions are purged after DECIDED_TTL_S, once
    # every offset of the prompt is long committed and no redelivery can reach it.
    closed_keys: dict[int, deque] = {}

    @app.agent(rewarded)
    async def aggregate(stream):
        async for event in stream.events():
            record = await emit.decode_or_dead_letter(event, "RewardedResponse")
            if record is None:
                continue
            response = record["response"]
            domain = response["domain"]
            if domain not in filters:
                await emit.dead_letter(event, "invalid_event", f"unknown domain {domain!r}; configured: {sorted(filters)}")
                continue
            pid = response["prompt_id"]
            key = pid.encode()
            raw_state = state_table.get(key)
            state = PromptState.from_dict(json.loads(raw_state)) if raw_state else None
            state, effects = step(state, record, filters[domain])
            for effect in effects:
                if isinstance(effect, ResponseAccepted):
                    responses_table[f"{pid}/{effect.sample_index}".encode()] = event.value
                elif isinstance(effect, ResponseRejected):
                    stats["responses_rejected"] += 1
                elif isinstance(effect, DuplicateResponse):
                    stats["duplicates"] += 1
                    log.info("duplicate response %s/%d ignored", pid, effect.sample_index)
                elif isinstance(effect, Replacement):
                    request = replacement_request(response, effect, derive_seed(config.seed, pid, effect.round))
                    await emit.send(topics.generation_requests, pid, request, "GenerationRequest")
                elif isinstance(effect, Decided):
                    await _emit_decision(pid, response, effect)
            was_open = state.decided is None or any(isinstance(e, Decided) for e in effects)
            if was_open:
                state_table[key] = json.dumps(state.to_dict()).encode()
            partition_closed = closed_keys.setdefault(event.message.partition, deque())
            if state.decided is not None and was_open:
                partition_closed.append((time.monotonic(), key))
            while partition_closed and time.monotonic() - partition_closed[0][0] > DECIDED_TTL_S:
                state_table.pop(partition_closed.popleft()[1], None)

    async def _emit_decision(pid: str, response: dict, decided: Decided) -> None:
        accepted_responses = []
        for index in decided.sample_indices:
            rkey = f"{pid}/{index}".encode()
            accepted_responses.append(decode(responses_table[rkey])[1])
            del responses_table[rkey]
        domain = response["domain"]
        group = decided_group(response, decided, accepted_responses, filter_json[domain], filter_hash[domain])
        if response.get("mode", "train") == "val":
            topic = topics.groups_validation
        else:
            topic = topics.groups_accepted if decided.accepted else topics.groups_rejected
        await emit.send(topic, pid, group, "Group")
        outcome = prompt_outcome(response, committed=decided.accepted, reason=decided.reason,
                                 rounds=decided.rounds, responses_generated=decided.responses_generated)
        await emit.send(topics.prompt_outcomes, pid, outcome, "PromptOutcome")
        stats["decided"] += 1

    app.rollstream_stats = stats  # read by tests and benchmarks run in-process
    return app
