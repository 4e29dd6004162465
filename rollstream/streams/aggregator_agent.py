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
from rollstream.kafka import names
from rollstream.kafka.context import StageContext
from rollstream.streams.aggregator_processor import AggregatorProcessor
from rollstream.streams.common import BATCH_WITHIN_S, processor_app

DEADLINE_CHECK_S = 2.0


def build_aggregator_app(config: RLVRConfig, context: StageContext, store: str = "memory://") -> faust.App:
    topics = context.topics
    return processor_app(config, context, app_name=names.AGGREGATOR_APP, table=names.PROMPT_STATE_TABLE,
                         sources=(topics.responses_rewarded, topics.generation_requests),
                         processor=lambda table, version_of: AggregatorProcessor(config, table, version_of),
                         name="aggregator.aggregate", within_s=BATCH_WITHIN_S, tick_interval_s=DEADLINE_CHECK_S,
                         store=store)
