"""Response aggregation + filters: a faust agent over ``responses.rewarded`` and
``generation.requests`` (co-partitioned, keyed by prompt_id) with one table keyed by prompt_id.
The work is rollstream.streams.aggregator_processor.AggregatorProcessor (no faust); this module reads and writes
the table and sends what it returns.

Requests give each prompt's open round a deadline (``prompt_timeout_s``); the timer
(``punctuate_every``) checks the deadlines of the prompts of the partitions this worker owns every
``DEADLINE_CHECK_S`` and reissues or aborts the late ones. Timer and agent take turns, so a
batch's held changes and a deadline never interleave.

Events are handled in batches (``streams.common.BATCH_MAX`` / ``BATCH_WITHIN_S``): each event is
applied in order against the newest value of its prompt, and each prompt's table value is written
once per batch, after the batch's last event of that prompt. A prompt's responses mostly arrive
together (one generation request yields them all), so this writes one changelog record per prompt
and batch instead of one per response, the stage's main cost. A batch that decided a prompt
flushes the producer as it ends. faust acknowledges a batch's events only after the batch, and
flushes the producer before it commits offsets, so every committed event's effect is in the
changelog.
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
from rollstream.kafka.context import StageContext
from rollstream.observability.metrics import process_metrics
from rollstream.policy.versions import STALENESS_VERSION_MAX_AGE_S, PolicyVersionWatcher
from rollstream.kafka.events import decode_expected
from rollstream.streams.aggregator_processor import AggregatorProcessor, count_effects, UnwrittenStateLost, prompt_partition
from rollstream.streams.common import (
    BATCH_MAX,
    BATCH_WITHIN_S,
    PRODUCER_LINGER_S,
    PRODUCER_MAX_BATCH_BYTES,
    Emitter,
    TableStore,
    active_partitions,
    make_app,
    punctuate_every,
)

log = logging.getLogger(__name__)

DECIDED_TTL_S = 300.0  # closed transactions are kept this long: well beyond the 1 s commit interval
DEADLINE_CHECK_S = 2.0


class AggregatorAgent:
    """The aggregator's faust shell around an AggregatorProcessor: handles batches of events, writes each
    changed prompt's table value once per batch, and runs the deadline timer; the two take turns."""

    def __init__(self, app: faust.App, config: RLVRConfig, store: TableStore, emit: Emitter,
                 versions: PolicyVersionWatcher | None) -> None:
        self.app, self.config, self.store, self.emit, self.versions = app, config, store, emit, versions
        self.topics = emit.topics
        self.partitions = config.kafka.partitions
        self.aggregation = AggregatorProcessor(config)
        self.metrics = process_metrics()
        self.closed_keys: dict[int, deque] = {}  # partition -> [(closed_at, key)], oldest first
        self.turn = asyncio.Lock()  # the agent's batches and the deadline timer take turns
        self.reindex = True  # the deadline index must be rebuilt from the table (start, rebalance)

    def closed(self, partition: int, key: bytes) -> None:
        self.closed_keys.setdefault(partition, deque()).append((time.monotonic(), key))

    async def handle(self, event, pending: dict[bytes, int], lost: list) -> None:
        """Apply one event; a prompt it changed goes to ``pending`` (key -> partition): its table
        value is written after the batch (AggregatorProcessor holds the newer state until then). A prompt
        whose held changes were lost goes to ``lost`` (the batch then ends the process)."""
        if event.message.topic == self.topics.generation_requests:
            await self.handle_request(event, pending, lost)
            return
        record = await self.emit.decode_or_dead_letter(event, "RewardedResponse")
        if record is None:
            return
        domain = record["response"]["domain"]
        if domain not in self.aggregation.filters:
            await self.emit.dead_letter(event, "invalid_event",
                                        f"unknown domain {domain!r}; configured: {sorted(self.aggregation.filters)}")
            return
        key = record["response"]["prompt_id"].encode()
        current = self.versions.latest_version(STALENESS_VERSION_MAX_AGE_S) if self.versions is not None else None
        try:
            applied = self.aggregation.apply(self.store.get(key), event.value, record, current)
        except UnwrittenStateLost as exc:
            lost.append(exc)
            return
        count_effects(self.metrics, applied.effects, record["response"].get("mode", "train"))
        for send in applied.sends:
            await self.emit.send_raw(send.topic, send.key, send.value)
        if applied.changed:
            pending[key] = event.message.partition
        if applied.duplicates:
            log.info("redelivered response of %s ignored", key.decode())
        if applied.decided is not None:
            self.closed(event.message.partition, key)

    async def handle_request(self, event, pending: dict[bytes, int], lost: list) -> None:
        """A GenerationRequest: its prompt's open round gets a deadline. An undecodable request or
        one of an unknown domain is skipped: the generation worker, its consumer, dead-letters
        it (a second dead letter would count it twice)."""
        _, record, problem = decode_expected(event.value, ("GenerationRequest",))
        if problem is not None or record["domain"] not in self.aggregation.filters:
            return
        key = record["prompt_id"].encode()
        try:
            applied = self.aggregation.request(self.store.get(key), record)
        except UnwrittenStateLost as exc:
            lost.append(exc)
            return
        if applied.changed:
            pending[key] = event.message.partition

    async def deadlines(self) -> None:
        """Reissue or abort the prompts past their deadline (AggregatorProcessor.tick); the timer
        calls it holding ``turn``."""
        active = active_partitions(self.app, self.topics.responses_rewarded)
        if self.reindex:
            self.reindex = False
            indexed = self.aggregation.index((k, v) for k, v in self.store.items()
                                             if prompt_partition(k.decode(), self.partitions) in active)
            log.info("deadline index rebuilt: %d prompts waiting in partitions %s", indexed, sorted(active))
        for pid in self.aggregation.due():
            await self.expire(pid, active)

    async def expire(self, pid: str, active: set[int]) -> None:
        key, partition = pid.encode(), prompt_partition(pid, self.partitions)
        if partition not in active:  # revoked since it was indexed
            self.aggregation.deadlines.pop(pid, None)
            return
        applied = self.aggregation.tick(pid, self.store.get(key))
        count_effects(self.metrics, applied.effects, applied.mode)
        for send in applied.sends:
            await self.emit.send_raw(send.topic, send.key, send.value, partition=send.partition)
        for effect in applied.effects:
            log.warning("prompt %s past its deadline (prompt_timeout_s %.0f): %s", pid,
                        self.config.prompt_timeout_s, effect)
        if self.aggregation.unwritten(pid):
            self.store.put(partition, key, self.aggregation.table_value(pid))
        if applied.decided is not None:
            self.closed(partition, key)

    async def handle_batch(self, events) -> None:
        async with self.turn:
            pending: dict[bytes, int] = {}
            lost: list[UnwrittenStateLost] = []
            try:
                for event in events:
                    await self.emit.guarded(lambda e: self.handle(e, pending, lost), event)
                    if lost:
                        break
            finally:
                for key, partition in pending.items():
                    if self.aggregation.unwritten(key.decode()):
                        self.store.put(partition, key, self.aggregation.table_value(key.decode()))
            await self.emit.flush()
            if lost:
                # an exception leaves the agent: the process exits (StageApp) before this batch is
                # acknowledged, and the restarted stage applies it again from the table
                raise lost[0]
            self.forget_closed({event.message.partition for event in events})  # partitions this worker owns

    def forget_closed(self, partitions: set[int]) -> None:
        """Delete the table values of transactions closed more than ``DECIDED_TTL_S`` ago."""
        now = time.monotonic()
        for partition in partitions:
            closed = self.closed_keys.get(partition)
            while closed and now - closed[0][0] > DECIDED_TTL_S:
                key = closed.popleft()[1]
                if key in self.store:
                    self.store.put(partition, key, None)


def build_aggregator_app(config: RLVRConfig, context: StageContext, store: str = "memory://") -> faust.App:
    topics = context.topics
    partitions = config.kafka.partitions
    app = make_app(names.app_id(topics, names.AGGREGATOR_APP), context.bootstrap, partitions, config.kafka, store,
                   producer_linger_s=PRODUCER_LINGER_S, producer_max_batch_bytes=PRODUCER_MAX_BATCH_BYTES)
    load_torch()  # the filters need it: imported while the app starts, not at the first decision
    inputs = app.topic(topics.responses_rewarded, topics.generation_requests, key_type=bytes, value_type=bytes,
                       key_serializer="raw", value_serializer="raw", partitions=partitions)
    table = app.Table(names.PROMPT_STATE_TABLE, default=None, partitions=partitions, key_type=bytes,
                      value_type=bytes, help="prompt_id -> PromptState + accepted RewardedResponse bytes")
    versions = PolicyVersionWatcher(context.bootstrap, topics) if config.max_staleness is not None else None
    agent = AggregatorAgent(app, config, TableStore(table), Emitter(app, context), versions)
    punctuate_every(app, DEADLINE_CHECK_S, agent.deadlines, agent.turn, "aggregator.deadlines")

    @app.on_rebalance_complete.connect
    async def reassigned(sender, **kwargs) -> None:
        agent.reindex = True

    @app.agent(inputs)
    async def aggregate(stream):
        async for events in stream.take_events(BATCH_MAX, within=BATCH_WITHIN_S):
            await agent.handle_batch(events)
    return app
