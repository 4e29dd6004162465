"""The one shape of an extension point (rollstream.extensions lists them all).

A ``Registry`` maps names to objects of one kind. Its built-ins are given as import path strings
when it is created, so the list of names lives in one place and nothing is imported until a name
is asked for (the config checks a name long before a worker imports the libraries behind it).
Built-in names are looked up first; any other name that is an import path (``pkg.module:attr``;
``pkg.module.attr`` also works) names a user's object, imported when it is first asked for. Every
object, built-in or not, is checked against the kind's protocol before it is handed out.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator, Mapping
from typing import Any, Generic, TypeVar

from rollstream.exceptions import ConfigError

T = TypeVar("T")


def is_import_path(name: str) -> bool:
    return ":" in name or "." in name


def import_object(path: str, kind: str = "object", error: type[Exception] = ConfigError) -> Any:
    """The callable ``path`` names: ``pkg.module:attr`` (``attr`` may be dotted, ``Class.method``)
    or ``pkg.module.attr``. A module under the working directory imports too (a console script
    has no working directory on ``sys.path``; it is added last), and one beside a loaded config
    file (rollstream.config.loading.with_base_dir adds its folder).

    Raises ``error`` (ConfigError by default) naming ``kind``, ``path`` and what failed: the
    module (not found, or its import raised), the attribute, or an object that is not callable."""
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr:
        raise error(f"{kind} {path!r} is not an import path 'pkg.module:attr'")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        where = "" if exc.name != module_name.split(".")[0] else (
            f" (looked up beside the config file, in the working directory {os.getcwd()} and in the installed packages)")
        raise error(f"cannot import {kind} {path!r}: module {module_name!r}: {type(exc).__name__}: {exc}{where}") from exc
    except Exception as exc:  # a user's module may fail to import with anything
        raise error(f"cannot import {kind} {path!r}: module {module_name!r}: {type(exc).__name__}: {exc}") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise error(f"cannot import {kind} {path!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise error(f"{kind} {path!r} is not callable ({type(obj).__name__})")
    return obj


class Registry(Mapping[str, T], Generic[T]):
    """``name -> object`` for one ``kind`` of extension (the config key that names it, used in
    errors); a Mapping of the built-ins.

    Args:
        kind: the config key, e.g. ``query_filter``, ``reward_type``, ``actor_infer.backend``.
        builtins: built-in name -> import path, imported on first use.
        protocol: what an object of this kind is, for errors (e.g. ``"a class with
            reset/step/close"``).
        methods: the methods a class of this kind must have; a function-kind registry has none.
        renamed: old spelling -> new: an old name is refused with one line naming the new one.
        error: the exception a bad name raises (a ConfigError subclass).
    """

    def __init__(self, kind: str, builtins: Mapping[str, str], protocol: str = "a callable",
                 methods: tuple[str, ...] = (), renamed: Mapping[str, str] | None = None,
                 error: type[ConfigError] = ConfigError) -> None:
        self.kind = kind
        self.protocol = protocol
        self.methods = methods
        self.renamed = dict(renamed or {})
        self.error = error
        self._paths: dict[str, str] = dict(builtins)
        self._objects: dict[str, T] = {}

    def names(self) -> tuple[str, ...]:
        """The built-in names, in the order given."""
        return tuple(self._paths)

    def __getitem__(self, name: str) -> T:
        if name not in self._objects:
            if name not in self._paths:
                raise KeyError(name)
            self._objects[name] = self.checked(name, import_object(self._paths[name], self.kind, self.error))
        return self._objects[name]

    def __contains__(self, name: object) -> bool:
        return name in self._paths

    def __iter__(self) -> Iterator[str]:
        return iter(self._paths)

    def __len__(self) -> int:
        return len(self._paths)

    def check_name(self, name: str) -> str:
        """``name`` if it is a built-in name or has the shape of an import path (imports nothing:
        for a config's validators). Raises ``error`` for a renamed or an unknown name."""
        if name in self._paths:
            return name
        if name in self.renamed:
            raise self.error(f"{self.kind} {name!r} is now spelled {self.renamed[name]!r}")
        if is_import_path(name):
            return name
        raise self.error(f"unknown {self.kind} {name!r}; valid: {sorted(self.names())} or an import path "
                         "'pkg.module:name'")

    def get_named(self, name: str) -> T:
        """The built-in ``name``, or the user's object its import path names, checked against the
        protocol. Raises ``error``: an unknown name (listing the valid ones), a renamed one
        (naming the new spelling), an import that fails (naming the module or attribute), or an
        object of the wrong kind (naming the protocol)."""
        if self.check_name(name) in self:
            return self[name]
        return self.checked(name, import_object(name, self.kind, self.error))

    def checked(self, name: str, obj: Any) -> T:
        """``obj`` if it fits the protocol: callable, and a class has every one of ``methods``."""
        missing = [m for m in self.methods if not callable(getattr(obj, m, None))] if isinstance(obj, type) else []
        if not callable(obj) or missing:
            lacks = f" (it lacks {', '.join(missing)})" if missing else ""
            raise self.error(f"{self.kind} {name!r} is a {type(obj).__name__ if not isinstance(obj, type) else 'class'}"
                             f"{lacks}, not {self.protocol}")
        return obj
