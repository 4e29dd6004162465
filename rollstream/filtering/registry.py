"""The query and response filter registries (rollstream.registry's idiom): built-ins by name, a
user's filter by import path (``pkg.module:attr`` or ``pkg.module.attr``)."""

from __future__ import annotations

import logging
from typing import Any, Callable

from rollstream.exceptions import UnknownFilterError
from rollstream.filtering.decision import Decision
from rollstream.filtering.reasons import RejectReason
from rollstream.registry import Registry
from rollstream.registry import import_object as _import_object

log = logging.getLogger(__name__)


class FilterRegistry(Registry[Callable]):
    """``name -> filter function``; ``resolve`` wraps a user's filter so it returns a Decision."""

    def __init__(self, kind: str, custom_reason: RejectReason) -> None:
        super().__init__(kind, error=UnknownFilterError, label=f"{kind} type")
        self.custom_reason = custom_reason

    def get_filter(self, name: str) -> Callable:
        """The registered filter, or the object an import path names. Raises UnknownFilterError
        listing the valid names."""
        return self.get_named(name)

    def resolve(self, name: str) -> Callable[[Any, Any], Decision]:
        """A registered filter as is, or a custom one wrapped so that it returns a Decision: a
        bool becomes accept / reject(custom_reason), and an exception rejects with
        ``filter_error`` (a bug in user code must not wedge the prompt's transaction)."""
        fn = self.get_filter(name)
        if name in self:
            return fn

        def custom(item: Any, filter_args: Any) -> Decision:
            try:
                out = fn(item, filter_args)
            except Exception:
                log.exception("custom %s %s raised", self.kind, name)
                return Decision.reject(RejectReason.FILTER_ERROR)
            if isinstance(out, Decision):
                return out
            return Decision.accept() if out else Decision.reject(self.custom_reason)

        return custom


def import_object(path: str, kind: str = "object") -> Callable:
    """The callable an import path names; UnknownFilterError (a ConfigError) when it does not."""
    return _import_object(path, kind, UnknownFilterError)


QUERY_FILTERS = FilterRegistry("query_filter", RejectReason.CUSTOM_QUERY_FILTER)
RESPONSE_FILTERS = FilterRegistry("response_filter", RejectReason.CUSTOM_RESPONSE_FILTER)
