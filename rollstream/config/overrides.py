"""Command-line overrides of a config file: ``key.sub=value`` pairs applied to the YAML's mapping
before it is validated, so an override goes through the same models and checks as the file.

A key is a dotted path: mapping keys, or list indices (``datasets.0.num_samples=64``). A value is
read as YAML: ``3``, ``0.5``, ``true``, ``null``, ``[a, b]`` and ``{k: v}`` keep their types;
anything else is a string. A path may name keys the file leaves out (their defaults then come
from the models); a key no model has is refused when the config is validated.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import yaml

from rollstream.exceptions import ConfigError


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"a.b=1"`` -> (["a", "b"], 1). Raises ConfigError for text without ``=``, an empty key or
    key part, or a value that is not YAML."""
    key, sep, raw = text.partition("=")
    path = key.strip().split(".")
    if not sep or not all(path):
        raise ConfigError(f"override {text!r}: expected KEY=VALUE with a dotted KEY, e.g. actor_train.lr=1e-6")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text}: the value is not valid YAML ({exc.problem})") from exc
    return path, value


def apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
    """A copy of ``data`` (a config mapping) with each of ``overrides`` (``key.sub=value``) set,
    left to right. Missing mappings along a path are created. Raises ConfigError naming the
    override for bad syntax, a path through a value that is neither a mapping nor a list, or a
    list index that is not an index of that list."""
    data = copy.deepcopy(data)
    for text in overrides:
        path, value = parse_override(text)
        node: Any = data
        for depth, part in enumerate(path):
            last = depth == len(path) - 1
            where = ".".join(path[:depth]) or "the config"
            if isinstance(node, dict):
                if last:
                    node[part] = value
                    continue
                if node.get(part) is None:  # left out of the file (or null): its defaults apply below
                    node[part] = {}
                node = node[part]
            elif isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise ConfigError(f"override {text}: {where} is a list of {len(node)}; {part!r} is not an index of it")
                if last:
                    node[int(part)] = value
                else:
                    node = node[int(part)]
            else:
                raise ConfigError(f"override {text}: {where} is {type(node).__name__} {node!r}, not a mapping")
    return data
