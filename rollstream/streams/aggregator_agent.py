"""Response aggregation + filters: a faust agent over ``responses.rewarded`` and
``generation.requests`` (co-partitioned, keyed by prompt_id) with one table keyed by prompt_id.
The work is rollstream.streams.aggregator_processor.AggregatorProcessor (no faust), run by
``streams.common.serve_processor``: events in batches (``BATCH_MAX`` / ``BATCH_WITHIN_S``), each
changed prompt's table value written once per batch (a prompt's responses mostly arrive
together: one changelog record per prompt and batch instead of one per response), and the
deadline timer every ``DEADLINE_CHECK_S``, taking turns with the batches.
"""

from __future__ import annotations

import faust

from rollstream.config import RLVRConfig
from rollstream.filtering.query_filters import load_torch
from rollstream.kafka import names
from rollstream.kafka.context import StageContext
from rollstream.policy.versions import STALENESS_VERSION_MAX_AGE_S, PolicyVersionWatcher
from rollstream.streams.aggregator_processor import AggregatorProcessor
from rollstream.streams.common import (
    BATCH_WITHIN_S,
    PRODUCER_LINGER_S,
    PRODUCER_MAX_BATCH_BYTES,
    Emitter,
    TableStore,
    make_app,
    raw_topic,
    serve_processor,
)

DEADLINE_CHECK_S = 2.0


def build_aggregator_app(config: RLVRConfig, context: StageContext, store: str = "memory://") -> faust.App:
    topics = context.topics
    partitions = config.kafka.partitions
    app = make_app(names.app_id(topics, names.AGGREGATOR_APP), context.bootstrap, partitions, config.kafka, store,
                   producer_linger_s=PRODUCER_LINGER_S, producer_max_batch_bytes=PRODUCER_MAX_BATCH_BYTES)
    load_torch()  # the filters need it: imported while the app starts, not at the first decision
    table = app.Table(names.PROMPT_STATE_TABLE, default=None, partitions=partitions, key_type=bytes,
                      value_type=bytes, help="prompt_id -> PromptState + accepted RewardedResponse bytes")
    versions = PolicyVersionWatcher(context.bootstrap, topics) if config.max_staleness is not None else None
    processor = AggregatorProcessor(config, TableStore(table),
                                    (lambda: versions.latest_version(STALENESS_VERSION_MAX_AGE_S))
                                    if versions is not None else (lambda: None))
    serve_processor(app, raw_topic(app, topics.responses_rewarded, topics.generation_requests, partitions=partitions),
                    processor, Emitter(app, context), name="aggregator.aggregate", within_s=BATCH_WITHIN_S,
                    tick_interval_s=DEADLINE_CHECK_S)
    return app
