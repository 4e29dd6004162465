"""docs/reference/config.md, generated from the config models: every key of an RLVR and an agentic
config, its type, default and description, one table per section. The page is never edited by
hand: ``python -m rollstream.config.reference > docs/reference/config.md`` (``make reference``)
writes it, and a test fails when it is stale or a field has no description."""

from __future__ import annotations

import json
import re
import sys
import types
import typing
from typing import Any, Iterator

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from rollstream.config.agentic import AgenticConfig
from rollstream.config.rlvr import RLVRConfig

ROOTS = (("RLVR config", RLVRConfig), ("Agentic config", AgenticConfig))
HEADER = """# Configuration reference

Every key of a config file (`rollstream run -c <file>`), generated from the config models'
descriptions by `make reference`; a test fails when this page and the models disagree. A config
is RLVR unless it has `train_env_manager` (agentic). Unknown keys are refused with the known ones
named. Nested sections are tables of their own below; `<name>` stands for a key you choose (a
reward domain, an environment tag) and `[]` for an item of a list.
"""


def models_of(annotation: Any) -> list[type[BaseModel]]:
    """The config models inside a field's annotation (``M``, ``M | None``, ``list[M]``,
    ``dict[str, M]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in models_of(arg)]


def suffix(annotation: Any) -> str:
    """How a nested model is reached below a key: ``[]`` for a list item, ``.<name>`` for a map value."""
    origin = typing.get_origin(annotation)
    if origin is list:
        return "[]"
    if origin is dict:
        return ".<name>"
    if origin in (typing.Union, types.UnionType):
        return next((suffix(a) for a in typing.get_args(annotation) if models_of(a)), "")
    return ""


def type_name(annotation: Any) -> str:
    """A reader's spelling of a field type: ``a | b`` for a Literal, model names for sections."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:  # a checked str (an extension's name): its base type
        return type_name(args[0])
    if origin is typing.Literal:
        return " \\| ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(type_name(a) for a in args)
    if origin is list:
        return f"list of {type_name(args[0])}"
    if origin is dict:
        return f"map of {type_name(args[0])} to {type_name(args[1])}"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return getattr(annotation, "__name__", str(annotation))


def default_of(field: Any) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    if isinstance(value, BaseModel):
        return "(section)"
    return f"`{json.dumps(value)}`"


def anchor(title: str) -> str:
    """The id MkDocs' toc gives a heading (lower case, word characters and hyphens, spaces to -)."""
    return re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", title.lower()).strip())


def sections(path: str, model: type[BaseModel], seen: dict[type, list[str]]) -> Iterator[tuple[str, type[BaseModel]]]:
    """(path, model) of ``model`` and every section below it, each model once (where first
    reached); ``seen`` collects every path that reaches each model."""
    seen[model] = [path]
    yield path, model
    for key, field in model.model_fields.items():
        for inner in models_of(field.annotation):
            at = f"{path}{'.' if path else ''}{key}{suffix(field.annotation)}"
            if inner in seen:
                seen[inner].append(at)
            else:
                yield from sections(at, inner, seen)


def heading(paths: list[str]) -> str:
    """A section's title: every key path that reaches it (one model may sit under several keys)."""
    return ", ".join(f"`{p}`" for p in paths)


def markdown_text(text: str) -> str:
    """``text`` on one line of a table cell: ``|`` escaped, and ``<`` outside code spans (a bare
    ``<name>`` would be an HTML tag)."""
    parts = " ".join(text.split()).replace("|", "\\|").split("`")
    return "`".join(part if i % 2 else part.replace("<", "&lt;") for i, part in enumerate(parts))


def table(model: type[BaseModel], seen: dict[type, list[str]]) -> list[str]:
    rows = ["| key | type | default | description |", "|---|---|---|---|"]
    for key, field in model.model_fields.items():
        description = markdown_text(field.description or "")
        inner = models_of(field.annotation)
        if inner:
            description += " " + ", ".join(f"[`{seen[m][0]}`](#{anchor(heading(seen[m]))})" for m in inner)
        rows.append(f"| `{key}` | {type_name(field.annotation)} | {default_of(field)} | {description.strip()} |")
    return rows


def undescribed() -> list[str]:
    """Every ``Model.field`` reachable from a config that has no description."""
    missing = []
    for _, root in ROOTS:
        for _, model in sections("", root, {}):
            missing += [f"{model.__name__}.{k}" for k, f in model.model_fields.items() if not f.description]
    return sorted(set(missing))


def render() -> str:
    """The page, as markdown."""
    out = [HEADER]
    documented: set[type] = set()
    for title, root in ROOTS:
        seen: dict[type, list[str]] = {}
        for path, model in list(sections("", root, seen)):
            if model in documented:
                continue
            documented.add(model)
            out += ["", f"## {heading(seen[model]) if path else title}", ""] + table(model, seen)
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
