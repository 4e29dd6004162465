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

# The example configs, installed with the package (in a checkout: the repository's examples/)
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def bundled_examples() -> list[str]:
    """The file names of the bundled example configs, e.g. ``rlvr_math.yaml``."""
    return sorted(p.name for p in EXAMPLES.glob("*.yaml"))


def resolve_config_path(path: str | Path) -> Path:
    """``path`` when it exists; else the bundled example of its file name, with or without
    ``.yaml`` (``rlvr_math``, ``rlvr_math.yaml``, ``examples/rlvr_math.yaml``), so an installed
    package runs its examples from any directory. Raises ConfigError naming the bundled examples
    when neither exists."""
    path = Path(path)
    if path.exists():
        return path
    name = path.name if path.suffix in (".yaml", ".yml") else f"{path.name}.yaml"
    if (EXAMPLES / name).is_file():
        return EXAMPLES / name
    raise ConfigError(f"config file not found: {path} (bundled examples: {', '.join(bundled_examples())})")


def _error_message(exc: ValidationError) -> str:
    problems = validation_problems(exc)
    if len(problems) == 1:  # one problem, one line
        return f"invalid config: {problems[0]}"
    return "invalid config:\n  " + "\n  ".join(problems)


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
    """Read and validate a YAML config file (or a bundled example: resolve_config_path), with
    ``overrides`` (``key.sub=value``, see rollstream.config.overrides) applied first. Raises
    ConfigError; a problem under an overridden key is one line naming the override."""
    path = resolve_config_path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror}") from exc
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
    keys = [(text, ".".join(parse_override(text)[0])) for text in reversed(overrides)]
    for problem in validation_problems(cause):
        where = problem.partition(": ")[0]
        for text, key in keys:
            if where == key or where.startswith(key + ".") or key.startswith(where + "."):
                return ConfigError(f"override {text}: {problem}")
    return exc
