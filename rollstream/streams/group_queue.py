"""The agentic group queue: a faust agent over ``trajectories`` (the Trajectory payload events)
+ ``episodes.control`` (both keyed by group_id, co-partitioned) with one changelog-backed table
of small records (queue states and member TrajectorySummaries). The work is
rollstream.streams.group_queue_processor.GroupQueueProcessor (no faust); this module feeds it
events and sends what it returns.

Events are handled in batches (``streams.common.BATCH_MAX`` events, or what arrived within
``BATCH_WITHIN_S``); the processor writes through ``HeldWrites``, so a key changed by many events
of a batch (a group's queue state) is written to the table once, when the batch ends, and a
member summary written and deleted in the same batch (its group decided) never reaches the
changelog. A batch that sent events flushes the producer as it ends. faust acknowledges a
batch's events only after the batch.

Deadlines: the timer (``punctuate_every``) calls the processor's ``tick`` with the partitions this
worker owns, taking turns with the agent's batches.
"""

from __future__ import annotations

import asyncio
import logging

import faust

from rollstream.config import AgenticConfig
from rollstream.filtering.query_filters import load_torch
from rollstream.kafka import names
from rollstream.kafka.context import StageContext
from rollstream.policy.versions import STALENESS_VERSION_MAX_AGE_S, PolicyVersionWatcher
from rollstream.streams.common import (
    BATCH_MAX,
    PRODUCER_LINGER_S,
    PRODUCER_MAX_BATCH_BYTES,
    Emitter,
    TableStore,
    active_partitions,
    make_app,
    punctuate_every,
)
from rollstream.streams.group_queue_processor import GroupQueueProcessor, Handled
from rollstream.streams.store import HeldWrites

log = logging.getLogger(__name__)

TICK_INTERVAL_S = 1.0
# Longer than the aggregator's window: a trajectory is larger and its events come in fewer,
# larger bursts; at 10 ms the batches on a backlog were smaller and the CPU per trajectory
# varied from run to run by a third (benchmarks/agentic.py).
BATCH_WITHIN_S = 0.05


def build_group_queue_app(config: AgenticConfig, context: StageContext, store: str = "memory://",
                          tick_interval_s: float = TICK_INTERVAL_S) -> faust.App:
    load_torch()  # the filters need it: imported while the app starts, not at the first decision
    topics = context.topics
    partitions = config.kafka.partitions
    app = make_app(names.app_id(topics, names.GROUP_QUEUE_APP), context.bootstrap, partitions, config.kafka, store,
                   producer_linger_s=PRODUCER_LINGER_S, producer_max_batch_bytes=PRODUCER_MAX_BATCH_BYTES)
    emit = Emitter(app, context)
    source = app.topic(topics.trajectories, topics.episodes_control, key_type=bytes, value_type=bytes,
                       key_serializer="raw", value_serializer="raw", partitions=partitions)
    table = app.Table(names.GROUP_QUEUE_TABLE, default=None, partitions=partitions, key_type=bytes,
                      value_type=bytes, help="group queues, member trajectories and filter state (see processor)")
    versions = PolicyVersionWatcher(context.bootstrap, topics) if config.max_staleness is not None else None
    held = HeldWrites(TableStore(table))
    processor = GroupQueueProcessor(config, held,
                                    (lambda: versions.latest_version(STALENESS_VERSION_MAX_AGE_S))
                                    if versions is not None else (lambda: None))
    turn = asyncio.Lock()  # batches and the timer take turns

    async def send(handled: Handled) -> None:
        for out in handled.sends:
            await emit.send_raw(out.topic, out.key, out.value, partition=out.partition)
        for line in handled.log:
            log.info("%s", line)

    async def handle(event) -> None:
        msg = event.message  # a trajectory's summary names its payload by (topic, partition, offset)
        handled = processor.handle(msg.topic, msg.partition, event.value, offset=msg.offset)
        if handled.error is not None:
            await emit.dead_letter(event, *handled.error)
        await send(handled)

    @app.agent(source)
    async def queue(stream):
        async for events in stream.take_events(BATCH_MAX, within=BATCH_WITHIN_S):
            async with turn:
                try:
                    for event in events:
                        await emit.guarded(handle, event)
                finally:
                    held.flush()
                await emit.flush()

    async def tick() -> None:
        try:
            await send(processor.tick(active_partitions(app, topics.trajectories)))
        finally:
            held.flush()

    punctuate_every(app, tick_interval_s, tick, turn, "group_queue.tick")
    return app
