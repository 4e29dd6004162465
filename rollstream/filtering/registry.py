"""Filters by name; an import path (``pkg.module:attr`` or ``pkg.module.attr``) names a custom one."""

from __future__ import annotations

import importlib
import logging
from typing import Any, Callable, TypeVar

from rollstream.exceptions import UnknownFilterError
from rollstream.filtering.decision import Decision
from rollstream.filtering.reasons import RejectReason

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable)



class Registry(dict):
    """name -> filter function; re-registering a name with another function raises."""

    def __init__(self, kind: str, custom_reason: RejectReason) -> None:
        super().__init__()
        self.kind = kind
        self.custom_reason = custom_reason

    def register(self, name: str) -> Callable[[F], F]:
        def deco(fn: F) -> F:
            if name in self and self[name] is not fn:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self[name] = fn
            return fn

        return deco

    def get_filter(self, name: str) -> Callable:
        """The registered filter, or the object an import path names.

        Raises UnknownFilterError listing the valid names.
        """
        if name in self:
            return self[name]
        if "." in name or ":" in name:
            return import_object(name, self.kind)
        raise UnknownFilterError(
            f"unknown {self.kind} type {name!r}; valid: {sorted(self)} or an import path 'pkg.module:name'"
        )


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
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise UnknownFilterError(f"cannot import {kind} {path!r}: {exc}") from exc
    if not callable(obj):
        raise UnknownFilterError(f"{kind} {path!r} is not callable")
    return obj


QUERY_FILTERS = Registry("query_filter", RejectReason.CUSTOM_QUERY_FILTER)
RESPONSE_FILTERS = Registry("response_filter", RejectReason.CUSTOM_RESPONSE_FILTER)
