"""Response aggregation + filters: a faust agent over ``responses.rewarded`` with one table keyed
by prompt_id. The work is rollstream.streams.aggregation.Aggregation (no faust); this module
reads and writes the table and sends what it returns.

Events are handled in batches (up to ``BATCH_MAX`` events, or what arrived within
``BATCH_WITHIN_S``): each event is applied in order against the newest value of its prompt, and
each prompt's table value is written once per batch, after the batch's last event of that
prompt. A prompt's responses mostly arrive together (one generation request yields them all), so
this writes one changelog record per prompt and batch instead of one per response, the stage's
main cost. faust acknowledges a batch's events only after the batch, and flushes the producer
before it commits offsets, so every committed event's effect is in the changelog.
"""

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
from rollstream.streams.aggregation import Aggregation, UnwrittenStateLost
from rollstream.streams.common import Emitter, make_app, raw_topic

log = logging.getLogger(__name__)

DECIDED_TTL_S = 300.0  # closed transactions are kept this long: well beyond the 1 s commit interval
BATCH_MAX = 1000  # events handled per batch at most
BATCH_WITHIN_S = 0.05  # a batch waits at most this long for more events
# Decisions add a Group and a PromptOutcome and every batch changelog records. Without a linger
# each became its own produce request (about 250 us of CPU per record here, more than the
# decision); 20 ms puts them in a few requests (about 55 us a record). Decisions are delayed by
# at most that much.
PRODUCER_LINGER_S = 0.02
PRODUCER_MAX_BATCH_BYTES = 1 << 20


def build_aggregator_app(config: RLVRConfig, bootstrap: str, store: str = "memory://") -> faust.App:
    topics = Topics(config.kafka.topic_prefix)
    partitions = config.kafka.partitions
    app = make_app(names.app_id(topics, names.AGGREGATOR_APP), bootstrap, partitions, store, config.kafka.max_message_bytes)
    app.conf.producer_linger = PRODUCER_LINGER_S
    app.conf.producer_max_batch_size = PRODUCER_MAX_BATCH_BYTES
    aggregation = Aggregation(config)
    metrics = process_metrics()
    emit = Emitter(app, topics, "aggregator")
    rewarded = raw_topic(app, topics.responses_rewarded, partitions)
    table = app.Table(names.PROMPT_STATE_TABLE, default=None, partitions=partitions, key_type=bytes,
                      value_type=bytes, help="prompt_id -> PromptState + accepted RewardedResponse bytes")
    closed_keys: dict[int, deque] = {}  # partition -> [(closed_at, key)], oldest first
    versions = PolicyVersionWatcher(bootstrap, topics) if config.max_staleness is not None else None

    def write(key: bytes, partition: int, value: bytes | None) -> None:
        """``table[key] = value`` (None: ``del table[key]``) for a key of source partition
        ``partition`` (the changelog is co-partitioned), outside the event that changed it."""
        if value is None:
            table.send_changelog(partition, key, None, value_serializer="raw")
            table.data.pop(key, None)
        else:
            table.send_changelog(partition, key, value)
            table.data[key] = value

    async def handle(event, pending: dict[bytes, int], lost: list) -> None:
        """Apply one event; a prompt it changed goes to ``pending`` (key -> partition): its table
        value is written after the batch (Aggregation holds the newer state until then). A prompt
        whose held changes were lost goes to ``lost`` (the batch then ends the process)."""
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
        try:
            applied = aggregation.apply(table.get(key), event.value, record, current)
        except UnwrittenStateLost as exc:
            lost.append(exc)
            return
        metrics.prompt_effects(applied.effects, record["response"].get("mode", "train"))
        for send in applied.sends:
            await emit.send_raw(send.topic, send.key, send.value)
        partition = event.message.partition
        if applied.changed:
            pending[key] = partition
        if applied.duplicates:
            log.info("redelivered response of %s ignored", key.decode())
        if applied.decided is not None:
            closed_keys.setdefault(partition, deque()).append((time.monotonic(), key))

    async def handle_batch(events) -> None:
        pending: dict[bytes, int] = {}
        lost: list[UnwrittenStateLost] = []
        try:
            for event in events:
                await emit.guarded(lambda e: handle(e, pending, lost), event)
                if lost:
                    break
        finally:
            for key, partition in pending.items():
                if aggregation.unwritten(key.decode()):
                    write(key, partition, aggregation.table_value(key.decode()))
        if lost:
            # an exception leaves the agent: the process exits (StageApp) before this batch is
            # acknowledged, and the restarted stage applies it again from the table
            raise lost[0]
        now = time.monotonic()
        for partition in {event.message.partition for event in events}:  # partitions this worker owns
            closed = closed_keys.get(partition)
            while closed and now - closed[0][0] > DECIDED_TTL_S:
                key = closed.popleft()[1]
                if key in table.data:
                    write(key, partition, None)

    @app.agent(rewarded)
    async def aggregate(stream):
        async for events in stream.take_events(BATCH_MAX, within=BATCH_WITHIN_S):
            await handle_batch(events)
    return app
