"""Response aggregation + filters: a faust agent over ``responses.rewarded`` and
``generation.requests`` (co-partitioned, keyed by prompt_id) with one table keyed by prompt_id.
The work is rollstream.streams.aggregation.Aggregation (no faust); this module reads and writes
the table and sends what it returns.

Requests give each prompt's open round a deadline (``prompt_timeout_s``); a timer checks the
deadlines of the prompts of the partitions this worker owns every ``DEADLINE_CHECK_S`` and
reissues or aborts the late ones. Timer and agent take turns (one lock), so a batch's held
changes and a deadline never interleave.

Events are handled in batches (up to ``BATCH_MAX`` events, or what arrived within
``BATCH_WITHIN_S``): each event is applied in order against the newest value of its prompt, and
each prompt's table value is written once per batch, after the batch's last event of that
prompt. A prompt's responses mostly arrive together (one generation request yields them all), so
this writes one changelog record per prompt and batch instead of one per response, the stage's
main cost. faust acknowledges a batch's events only after the batch, and flushes the producer
before it commits offsets, so every committed event's effect is in the changelog.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

import faust

from rollstream.config import RLVRConfig
from rollstream.filtering.query_filters import load_torch
from rollstream.kafka import names
from rollstream.kafka.cluster import Bootstrap
from rollstream.kafka.topics import Topics
from rollstream.observability.metrics import process_metrics
from rollstream.policy.versions import STALENESS_VERSION_MAX_AGE_S, PolicyVersionWatcher
from rollstream.kafka.events import decode_expected
from rollstream.streams.aggregation import Aggregation, count_effects, UnwrittenStateLost, prompt_partition
from rollstream.streams.common import Emitter, make_app

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
DEADLINE_CHECK_S = 2.0


def build_aggregator_app(config: RLVRConfig, bootstrap: Bootstrap, store: str = "memory://") -> faust.App:
    topics = Topics(config.kafka.topic_prefix)
    partitions = config.kafka.partitions
    app = make_app(names.app_id(topics, names.AGGREGATOR_APP), bootstrap, partitions, config.kafka, store)
    app.conf.producer_linger = PRODUCER_LINGER_S
    app.conf.producer_max_batch_size = PRODUCER_MAX_BATCH_BYTES
    load_torch()  # the filters need it; imported before the event loop runs, not at the first decision
    aggregation = Aggregation(config)
    metrics = process_metrics()
    emit = Emitter(app, topics, "aggregator")
    inputs = app.topic(topics.responses_rewarded, topics.generation_requests, key_type=bytes, value_type=bytes,
                       key_serializer="raw", value_serializer="raw", partitions=partitions)
    table = app.Table(names.PROMPT_STATE_TABLE, default=None, partitions=partitions, key_type=bytes,
                      value_type=bytes, help="prompt_id -> PromptState + accepted RewardedResponse bytes")
    closed_keys: dict[int, deque] = {}  # partition -> [(closed_at, key)], oldest first
    turn = asyncio.Lock()  # the agent's batches and the deadline timer take turns
    reindex = [True]  # the deadline index must be rebuilt from the table (start, rebalance)
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
        if event.message.topic == topics.generation_requests:
            await handle_request(event, pending, lost)
            return
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
        count_effects(metrics, applied.effects, record["response"].get("mode", "train"))
        for send in applied.sends:
            await emit.send_raw(send.topic, send.key, send.value)
        partition = event.message.partition
        if applied.changed:
            pending[key] = partition
        if applied.duplicates:
            log.info("redelivered response of %s ignored", key.decode())
        if applied.decided is not None:
            closed_keys.setdefault(partition, deque()).append((time.monotonic(), key))

    async def handle_request(event, pending: dict[bytes, int], lost: list) -> None:
        """A GenerationRequest: its prompt's open round gets a deadline. An undecodable request or
        one of an unknown domain is skipped: the generation worker, its consumer, dead-letters
        it (a second dead letter would count it twice)."""
        _, record, problem = decode_expected(event.value, ("GenerationRequest",))
        if problem is not None or record["domain"] not in aggregation.filters:
            return
        key = record["prompt_id"].encode()
        try:
            applied = aggregation.request(table.get(key), record)
        except UnwrittenStateLost as exc:
            lost.append(exc)
            return
        if applied.changed:
            pending[key] = event.message.partition

    @app.timer(DEADLINE_CHECK_S)
    async def deadlines() -> None:
        """Reissue or abort the prompts past their deadline (Aggregation.tick)."""
        async with turn:
            active = {tp.partition for tp in app.assignor.assigned_actives() if tp.topic == topics.responses_rewarded}
            if reindex[0]:
                reindex[0] = False
                indexed = aggregation.index((k, v) for k, v in list(table.data.items())
                                            if prompt_partition(k.decode(), partitions) in active)
                log.info("deadline index rebuilt: %d prompts waiting in partitions %s", indexed, sorted(active))
            for pid in aggregation.due():
                key, partition = pid.encode(), prompt_partition(pid, partitions)
                if partition not in active:  # revoked since it was indexed
                    aggregation.deadlines.pop(pid, None)
                    continue
                applied = aggregation.tick(pid, table.get(key))
                count_effects(metrics, applied.effects, applied.mode)
                for send in applied.sends:
                    await emit.send_raw(send.topic, send.key, send.value, partition=send.partition)
                for effect in applied.effects:
                    log.warning("prompt %s past its deadline (prompt_timeout_s %.0f): %s", pid,
                                config.prompt_timeout_s, effect)
                if aggregation.unwritten(pid):
                    write(key, partition, aggregation.table_value(pid))
                if applied.decided is not None:
                    closed_keys.setdefault(partition, deque()).append((time.monotonic(), key))

    @app.on_rebalance_complete.connect
    async def reassigned(sender, **kwargs) -> None:
        reindex[0] = True

    async def handle_batch(events) -> None:
        async with turn:
            await _handle_batch(events)

    async def _handle_batch(events) -> None:
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

    @app.agent(inputs)
    async def aggregate(stream):
        async for events in stream.take_events(BATCH_MAX, within=BATCH_WITHIN_S):
            await handle_batch(events)
    return app
