"""YAML or a mapping -> the pipeline's validated, frozen config. Invalid input raises
ConfigError naming each field path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from rollstream.config.agentic import AgenticConfig
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


def load_config(path: str | Path) -> Config:
    """Read and validate a YAML config file. Raises ConfigError."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"config file not found: {path}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    return parse_config(data)
