"""YAML or a mapping -> the pipeline's validated, frozen config. Invalid input raises
ConfigError naming each field path."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import yaml
from pydantic import ValidationError

from rollstream.config.agentic import AgenticConfig
from rollstream.config.overrides import apply_overrides, parse_override
from rollstream.config.rlvr import RLVRConfig
from rollstream.exceptions import ConfigError, validation_problems

Config = RLVRConfig | AgenticConfig


def _error_message(exc: ValidationError) -> str:
    return "invalid config:\n  " + "\n  ".join(validation_problems(exc))


def parse_config(data: Any) -> Config:
    """Validate a mapping: an AgenticConfig when it has ``train_env_manager``, else an RLVRConfig.
    Raises ConfigError with field paths."""
    if not isinstance(data, dict):
        raise ConfigError(f"config must be a mapping, got {type(data).__name__}")
    model = AgenticConfig if "train_env_manager" in data else RLVRConfig
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_error_message(exc)) from exc


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> Config:
    """Read and validate a YAML config file, with ``overrides`` (``key.sub=value``, see
    rollstream.config.overrides) applied first. Raises ConfigError; a problem under an overridden
    key is one line naming the override."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"config file not found: {path}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not overrides:
        return parse_config(data)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: config must be a mapping, got {type(data).__name__}")
    try:
        return parse_config(apply_overrides(data, overrides))
    except ConfigError as exc:
        raise _blame_override(exc, overrides) from exc.__cause__


def _blame_override(exc: ConfigError, overrides: Sequence[str]) -> ConfigError:
    """``exc`` as one line naming the override its first matching problem concerns (a problem
    at or under the override's key, or at a key the override created: an unknown section); the
    last such override wins, as it was applied last. ``exc`` itself when none matches."""
    cause = exc.__cause__
    if not isinstance(cause, ValidationError):
        return exc
    for problem in validation_problems(cause):
        where = problem.partition(": ")[0]
        for text in reversed(overrides):
            key = ".".join(parse_override(text)[0])
            if where == key or where.startswith(key + ".") or key.startswith(where + "."):
                return ConfigError(f"override {text}: {problem}")
    return exc
