"""A filter by name: a built-in of rollstream.extensions' QUERY_FILTERS / RESPONSE_FILTERS, or a
user's filter by import path, wrapped so that it returns a Decision."""

from __future__ import annotations

import logging
from typing import Any, Callable

from rollstream.exceptions import UnknownFilterError
from rollstream.extensions import QUERY_FILTERS, RESPONSE_FILTERS
from rollstream.filtering.decision import Decision
from rollstream.filtering.reasons import RejectReason
from rollstream.registry import Registry

log = logging.getLogger(__name__)

_CUSTOM_REASON = {QUERY_FILTERS.kind: RejectReason.CUSTOM_QUERY_FILTER,
                  RESPONSE_FILTERS.kind: RejectReason.CUSTOM_RESPONSE_FILTER}


def resolve_filter(registry: Registry, name: str) -> Callable[[Any, Any], Decision]:
    """The filter ``name`` names in ``registry`` (QUERY_FILTERS or RESPONSE_FILTERS): a built-in
    as is, a user's wrapped so that it returns a Decision. A bool becomes accept / reject
    (``custom_query_filter`` / ``custom_response_filter``), and an exception rejects with
    ``filter_error`` (a bug in user code must not wedge the prompt's transaction).

    Raises UnknownFilterError listing the valid names, or naming what failed to import."""
    fn = registry.get_named(name)
    if name in registry:
        return fn
    reason = _CUSTOM_REASON[registry.kind]

    def custom(item: Any, filter_args: Any) -> Decision:
        try:
            out = fn(item, filter_args)
        except Exception:
            log.exception("custom %s %s raised", registry.kind, name)
            return Decision.reject(RejectReason.FILTER_ERROR)
        if isinstance(out, Decision):
            return out
        return Decision.accept() if out else Decision.reject(reason)

    return custom


__all__ = ["QUERY_FILTERS", "RESPONSE_FILTERS", "UnknownFilterError", "resolve_filter"]
