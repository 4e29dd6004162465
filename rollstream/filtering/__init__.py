"""Pure filtering core: no Kafka, no asyncio.

The same functions decide in the stream processors, in offline replay/what-if, in tests and in
benchmarks.
"""

from rollstream.filtering.admission import AdmissionLimits, AdmissionState
from rollstream.filtering.decision import Decision
from rollstream.filtering.group_filters import (
    DropFlagGroupFilter,
    EnvFailureStdGroupFilter,
    GroupFilter,
    filter_group,
    load_group_filter,
)
from rollstream.filtering.prompt_state import DomainFilters, PromptState
from rollstream.filtering.query_filters import decide_query, query_filter
from rollstream.filtering.ratio_guard import DropFlagRatioGuard
from rollstream.filtering.reasons import ACCEPTED, RejectReason
from rollstream.filtering.registry import QUERY_FILTERS, RESPONSE_FILTERS, UnknownFilterError
from rollstream.filtering.response_filters import decide_response

__all__ = [
    "ACCEPTED", "AdmissionLimits", "AdmissionState", "Decision", "DomainFilters", "DropFlagGroupFilter",
    "DropFlagRatioGuard", "EnvFailureStdGroupFilter", "GroupFilter", "PromptState",
    "QUERY_FILTERS", "RESPONSE_FILTERS", "RejectReason", "UnknownFilterError", "decide_query",
    "decide_response", "filter_group", "load_group_filter", "query_filter",
]
