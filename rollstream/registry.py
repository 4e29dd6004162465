"""Named extension points: query, response and group filters, reward functions and advantage
estimators are all found the same way.

A ``Registry`` maps names to objects of one kind. A built-in is registered where it is defined
(``@REGISTRY.register("name")``) or, when a module must know the names without importing their
code (the config validates a name long before a worker imports the reward libraries), as an import
path string given to the registry at creation: the list of built-in names lives in that one
place. Any other name that is an import path (``pkg.module:attr``; ``pkg.module.attr`` also works)
names a user's object, imported when it is first asked for.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Any, Callable, Generic, TypeVar

from rollstream.exceptions import ConfigError

T = TypeVar("T")


def is_import_path(name: str) -> bool:
    return ":" in name or "." in name


def import_object(path: str, kind: str = "object", error: type[Exception] = ConfigError) -> Any:
    """The callable ``path`` (``pkg.module:attr`` or ``pkg.module.attr``) names.

    Raises ``error`` (ConfigError by default) naming ``kind`` and ``path`` when the module or the
    attribute is missing or the object is not callable."""
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise error(f"cannot import {kind} {path!r}: {exc}") from exc
    if not callable(obj):
        raise error(f"{kind} {path!r} is not callable")
    return obj


class Registry(Mapping[str, T], Generic[T]):
    """``name -> object`` for one ``kind`` of extension (the config key that names it, used in
    errors); a Mapping of the built-ins.

    Args:
        kind: e.g. ``query_filter``, ``reward_type``, ``adv_estimator``.
        builtins: built-ins known by import path, imported on first use (see the module doc).
        error: the exception an unknown name raises (a ConfigError subclass).
        label: what an unknown name is called in that error (default ``kind``).
    """

    def __init__(self, kind: str, builtins: Mapping[str, str] | None = None,
                 error: type[ConfigError] = ConfigError, label: str | None = None) -> None:
        self.kind = kind
        self.error = error
        self.label = label or kind
        self._paths: dict[str, str] = dict(builtins or {})
        self._objects: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: register the decorated object as ``name``. Raises ValueError when another
        object has the name already."""
        def deco(obj: T) -> T:
            if self._objects.get(name, obj) is not obj or name in self._paths:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._objects[name] = obj
            return obj

        return deco

    def names(self) -> tuple[str, ...]:
        """The built-in names, in registration order."""
        return tuple(self._paths) + tuple(n for n in self._objects if n not in self._paths)

    def __getitem__(self, name: str) -> T:
        if name not in self._objects:
            if name not in self._paths:
                raise KeyError(name)
            self._objects[name] = import_object(self._paths[name], self.kind, self.error)
        return self._objects[name]

    def __contains__(self, name: object) -> bool:
        return name in self._paths or name in self._objects

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def get_named(self, name: str) -> T:
        """The built-in ``name``, or the user's object its import path names.

        Raises ``error`` listing the valid names when it is neither."""
        if name in self:
            return self[name]
        if is_import_path(name):
            return import_object(name, self.kind, self.error)
        raise self.error(f"unknown {self.label} {name!r}; valid: {sorted(self.names())} or an import path "
                         "'pkg.module:name'")
