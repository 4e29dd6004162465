"""Filters by name; an import path (``pkg.module:attr`` or ``pkg.module.attr``) names a custom one."""

from __future__ import annotations

import importlib
from typing import Callable, TypeVar

from rollstream.exceptions import ConfigError

F = TypeVar("F", bound=Callable)


class UnknownFilterError(ConfigError):
    """A filter type is neither a registered name nor an importable object."""


class Registry(dict):
    """name -> filter function; re-registering a name with another function raises."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

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


def import_object(path: str, kind: str = "object") -> Callable:
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise UnknownFilterError(f"cannot import {kind} {path!r}: {exc}") from exc
    if not callable(obj):
        raise UnknownFilterError(f"{kind} {path!r} is not callable")
    return obj


QUERY_FILTERS = Registry("query_filter")
RESPONSE_FILTERS = Registry("response_filter")
