"""YAML or a mapping -> the pipeline's validated, frozen config. Invalid input raises
ConfigError naming each field path."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Sequence

import yaml
from pydantic import ValidationError

from rollstream.config.agentic import AgenticConfig
from rollstream.config.overrides import apply_overrides, parse_override
from rollstream.config.rlvr import RLVRConfig
from rollstream.config.sources import loader_of
from rollstream.exceptions import ConfigError, validation_problems

Config = RLVRConfig | AgenticConfig

# The example configs, installed with the package (in a checkout: the repository's examples/)
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def bundled_examples() -> list[str]:
    """The bundled example configs by their path under the examples folder, e.g.
    ``rlvr_math.yaml``, ``byo/rlvr_own.yaml``."""
    return sorted(p.relative_to(EXAMPLES).as_posix() for p in EXAMPLES.rglob("*.yaml"))


def resolve_config_path(path: str | Path) -> Path:
    """``path`` when it exists; else the bundled example it names, with or without ``.yaml`` and
    ``examples/`` (``rlvr_math``, ``examples/rlvr_math.yaml``, ``byo/rlvr_own``), so an
    installed package runs its examples from any directory. Raises ConfigError naming the
    bundled examples when neither exists."""
    path = Path(path)
    if path.exists():
        return path
    under = Path(*path.parts[1:]) if path.parts[:1] == ("examples",) and len(path.parts) > 1 else path
    bundled = EXAMPLES / (under if under.suffix in (".yaml", ".yml") else f"{under}.yaml")
    if not path.is_absolute() and bundled.is_file():
        return bundled
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
    ``overrides`` (``key.sub=value``, see rollstream.config.overrides) applied first; its
    relative paths resolve against its folder first (``with_base_dir``). Raises ConfigError; a
    problem under an overridden key is one line naming the override."""
    path = resolve_config_path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        if overrides:
            raise ConfigError(f"{path}: config must be a mapping, got {type(data).__name__}")
        return parse_config(data)  # raises, naming the type
    try:
        return parse_config(with_base_dir(apply_overrides(data, overrides) if overrides else data, path.parent))
    except ConfigError as exc:
        if not overrides:
            raise
        raise _blame_override(exc, overrides) from exc.__cause__


def with_base_dir(data: dict, folder: Path) -> dict:
    """``data`` (a config mapping) with ``base_dir`` set to ``folder`` (absolute; a ``base_dir``
    already there is kept: the config a run writes for its stages), and each relative file source
    of its ``datasets`` that exists under ``base_dir`` made absolute. ``base_dir`` goes first on
    ``sys.path`` (as a script's own folder does), so the modules of import paths (``reward_type:
    my_rewards:fn``) beside the config import from any working directory, ahead of an installed
    package of the same name, in `rollstream run` and in every stage alike."""
    base = Path(data.get("base_dir") or folder).resolve()
    out = {**data, "base_dir": str(base)}
    if isinstance(data.get("datasets"), list):
        out["datasets"] = [_resolved_source(d, base) for d in data["datasets"]]
    if str(base) not in sys.path:
        sys.path.insert(0, str(base))
    return out


def _resolved_source(dataset: Any, base: Path) -> Any:
    source = dataset.get("source") if isinstance(dataset, dict) else None
    if not isinstance(source, str) or loader_of(source) is not None or Path(source).expanduser().is_absolute():
        return dataset
    beside = base / source
    return {**dataset, "source": str(beside)} if beside.exists() else dataset


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
