"""Response aggregation + filters: a faust agent over ``responses.rewarded`` with one table keyed
by prompt_id. The work is rollstream.streams.aggregation.Aggregation (no faust); this module
reads and writes the table and sends what it returns."""

from __future__ import annotations

import logging
import time
from collections import deque

import faust

from rollstream.config import RLVRConfig
from rollstream.kafka import names
from rollstream.kafka.topics import Topics
from rollstream.observability.metrics import process_metrics
from rollstream.policy.versions import STALENESS_VERSION_MAX_AGE_S, PolicyVersionWatcher
from rollstream.streams.aggregation import Aggregation
from rollstream.streams.common import Emitter, make_app, raw_topic

log = logging.getLogger(__name__)

DECIDED_TTL_S = 300.0  # closed transactions are kept this long: well beyond the 1 s commit interval


def build_aggregator_app(config: RLVRConfig, bootstrap: str, store: str = "memory://") -> faust.App:
    topics = Topics(config.kafka.topic_prefix)
    partitions = config.kafka.partitions
    app = make_app(names.app_id(topics, names.AGGREGATOR_APP), bootstrap, partitions, store)
    aggregation = Aggregation(config)
    metrics = process_metrics()
    emit = Emitter(app, topics, "aggregator")
    rewarded = raw_topic(app, topics.responses_rewarded, partitions)
    table = app.Table(names.PROMPT_STATE_TABLE, default=None, partitions=partitions, key_type=bytes,
                      value_type=bytes, help="prompt_id -> PromptState + accepted RewardedResponse bytes")
    closed_keys: dict[int, deque] = {}  # partition -> [(closed_at, key)], oldest first
    versions = PolicyVersionWatcher(bootstrap, topics) if config.max_staleness is not None else None

    async def handle(event) -> None:
        record = await emit.decode_or_dead_letter(event, "RewardedResponse")
        if record is None:
            return
        domain = record["response"]["domain"]
        if domain not in aggregation.filters:
            await emit.dead_letter(event, "invalid_event",
                                   f"unknown domain {domain!r}; configured: {sorted(aggregation.filters)}")
            return
        key = record["response"]["prompt_id"].encode()
        current = versions.latest_version(STALENESS_VERSION_MAX_AGE_S) if versions is not None else None
        applied = aggregation.apply(table.get(key), event.value, record, current)
        metrics.prompt_effects(applied.effects, record["response"].get("mode", "train"))
        for send in applied.sends:
            await emit.send_raw(send.topic, send.key, send.value)
        if applied.value is not None:
            table[key] = applied.value
        if applied.duplicates:
            log.info("redelivered response of %s ignored", key.decode())
        closed = closed_keys.setdefault(event.message.partition, deque())
        if applied.decided is not None:
            closed.append((time.monotonic(), key))
        while closed and time.monotonic() - closed[0][0] > DECIDED_TTL_S:
            table.pop(closed.popleft()[1], None)

    @app.agent(rewarded)
    async def aggregate(stream):
        async for event in stream.events():
            await emit.guarded(handle, event)
    return app
