"""Commands whose options arrive as one typed record.

A command with many options would otherwise be a function with one parameter per option. Here the
options are the fields of a frozen dataclass whose defaults are ``typer.Option`` /
``typer.Argument``; :func:`command_options` gives typer the signature those fields make and calls
the command with the filled-in record.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from typing import Any, Callable, TypeVar

R = TypeVar("R")


def command_options(record: type[R]) -> Callable[[Callable[[R], None]], Callable[..., None]]:
    """Decorate ``fun(options: record) -> None`` into a typer command whose parameters are
    ``record``'s fields (names, types and typer defaults as declared). Raises TypeError when
    ``record`` is not a dataclass."""
    if not dataclasses.is_dataclass(record):
        raise TypeError(f"{record!r} is not a dataclass")
    types = typing.get_type_hints(record)
    fields = dataclasses.fields(record)
    parameters = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=types[f.name])
                  for f in fields]

    def decorate(fun: Callable[[R], None]) -> Callable[..., None]:
        @functools.wraps(fun)
        def command(**values: Any) -> None:
            return fun(record(**values))

        del command.__wrapped__  # typer must read the fields' signature, not ``fun``'s
        command.__signature__ = inspect.Signature(parameters)
        command.__annotations__ = {f.name: types[f.name] for f in fields}
        return command

    return decorate
