"""The agentic group queue: a faust agent over ``trajectories`` (the Trajectory payload events)
+ ``episodes.control`` (both keyed by group_id, co-partitioned) with one changelog-backed table
of small records (queue states and member TrajectorySummaries). The work is
rollstream.streams.group_queue_processor.GroupQueueProcessor (no faust); this module feeds it
events and sends what it returns.

Deadlines need a clock, but faust tables may only change while handling an event of their
partition. A timer therefore sends a ``tick`` GroupCommand to every partition of
``episodes.control`` this worker owns; the agent handles the tick like any other event.
"""

from __future__ import annotations

import logging

import faust

from rollstream.config import AgenticConfig
from rollstream.filtering.query_filters import load_torch
from rollstream.kafka import names
from rollstream.kafka.cluster import Bootstrap
from rollstream.kafka.topics import Topics
from rollstream.policy.versions import STALENESS_VERSION_MAX_AGE_S, PolicyVersionWatcher
from rollstream.runtime import now_ms
from rollstream.schemas import encode
from rollstream.streams.common import Emitter, active_partitions, make_app, raw_topic
from rollstream.streams.group_queue_processor import GroupQueueProcessor

log = logging.getLogger(__name__)

TICK_INTERVAL_S = 1.0


def build_group_queue_app(config: AgenticConfig, bootstrap: Bootstrap, store: str = "memory://",
                          tick_interval_s: float = TICK_INTERVAL_S) -> faust.App:
    load_torch()  # the filters need it; imported before the event loop runs, not at the first decision
    topics = Topics(config.kafka.topic_prefix)
    partitions = config.kafka.partitions
    app = make_app(names.app_id(topics, names.GROUP_QUEUE_APP), bootstrap, partitions, config.kafka, store)
    emit = Emitter(app, topics, "group-queue")
    source = app.topic(topics.trajectories, topics.episodes_control, key_type=bytes, value_type=bytes,
                       key_serializer="raw", value_serializer="raw", partitions=partitions)
    control = raw_topic(app, topics.episodes_control, partitions)
    table = app.Table(names.GROUP_QUEUE_TABLE, default=None, partitions=partitions, key_type=bytes,
                      value_type=bytes, help="group queues, member trajectories and filter state (see processor)")
    versions = PolicyVersionWatcher(bootstrap, topics) if config.max_staleness is not None else None
    processor = GroupQueueProcessor(config, table, (lambda: versions.latest_version(STALENESS_VERSION_MAX_AGE_S))
                                    if versions is not None else (lambda: None))

    async def handle(event) -> None:
        msg = event.message  # a trajectory's summary names its payload by (topic, partition, offset)
        handled = processor.handle(msg.topic, msg.partition, event.value, offset=msg.offset)
        if handled.error is not None:
            await emit.dead_letter(event, *handled.error)
        for send in handled.sends:
            await emit.send_raw(send.topic, send.key, send.value, partition=send.partition)
        for line in handled.log:
            log.info("%s", line)

    @app.agent(source)
    async def queue(stream):
        async for event in stream.events():
            await emit.guarded(handle, event)

    @app.timer(interval=tick_interval_s)
    async def tick() -> None:
        tick_value = encode({"command": "tick", "created_ms": now_ms()}, "GroupCommand")
        for partition in active_partitions(app, topics.episodes_control):
            await control.send(key=b"tick", value=tick_value, partition=partition)

    return app
