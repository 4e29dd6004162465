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
from rollstream.kafka import names
from rollstream.kafka.context import StageContext
from rollstream.streams.common import processor_app
from rollstream.streams.group_queue_processor import GroupQueueProcessor
from rollstream.streams.store import HeldWrites

TICK_INTERVAL_S = 1.0
# Longer than the aggregator's window: a trajectory is larger and its events come in fewer,
# larger bursts; at 10 ms the batches on a backlog were smaller and the CPU per trajectory
# varied from run to run by a third (benchmarks/agentic.py).
BATCH_WITHIN_S = 0.05


def build_group_queue_app(config: AgenticConfig, context: StageContext, store: str = "memory://",
                          tick_interval_s: float = TICK_INTERVAL_S) -> faust.App:
    topics = context.topics
    return processor_app(config, context, app_name=names.GROUP_QUEUE_APP, table=names.GROUP_QUEUE_TABLE,
                         sources=(topics.trajectories, topics.episodes_control),
                         processor=lambda table, version_of: GroupQueueProcessor(config, HeldWrites(table), version_of),
                         name="group_queue.queue", within_s=BATCH_WITHIN_S, tick_interval_s=tick_interval_s,
                         store=store)
