"""The agentic group queue: a faust agent over ``trajectories`` (the Trajectory payload events)
+ ``episodes.control`` (both keyed by group_id, co-partitioned) with one changelog-backed table
of small records (queue states and member TrajectorySummaries). The work is
rollstream.streams.group_queue_processor.GroupQueueProcessor (no faust), run by
``streams.common.serve_processor``.

It writes through ``HeldWrites``, so a key changed by many events of a batch (a group's queue
state) is written to the table once, when the batch ends, and a member summary written and deleted
in the same batch (its group decided) never reaches the changelog. The timer ticks every
``TICK_INTERVAL_S`` (run deadlines), taking turns with the batches.
"""

from __future__ import annotations

import faust

from rollstream.config import AgenticConfig
from rollstream.filtering.query_filters import load_torch
from rollstream.kafka import names
from rollstream.kafka.context import StageContext
from rollstream.policy.versions import STALENESS_VERSION_MAX_AGE_S, PolicyVersionWatcher
from rollstream.streams.common import (
    PRODUCER_LINGER_S,
    PRODUCER_MAX_BATCH_BYTES,
    Emitter,
    TableStore,
    make_app,
    raw_topic,
    serve_processor,
)
from rollstream.streams.group_queue_processor import GroupQueueProcessor
from rollstream.streams.store import HeldWrites

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
    table = app.Table(names.GROUP_QUEUE_TABLE, default=None, partitions=partitions, key_type=bytes,
                      value_type=bytes, help="group queues, member trajectories and filter state (see processor)")
    versions = PolicyVersionWatcher(context.bootstrap, topics) if config.max_staleness is not None else None
    processor = GroupQueueProcessor(config, HeldWrites(TableStore(table)),
                                    (lambda: versions.latest_version(STALENESS_VERSION_MAX_AGE_S))
                                    if versions is not None else (lambda: None))
    serve_processor(app, raw_topic(app, topics.trajectories, topics.episodes_control, partitions=partitions),
                    processor, Emitter(app, context), name="group_queue.queue", within_s=BATCH_WITHIN_S,
                    tick_interval_s=tick_interval_s)
    return app
