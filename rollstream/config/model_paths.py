"""Where a configured model lives: ``pretrain`` / ``model_args.model_name_or_path`` -> a complete
Hugging Face model folder, by file checks alone (no model code is imported, so a config loads in
milliseconds and a bad path fails before any process starts).

A name is a local folder when it exists on disk or looks like a path (absolute, ``./``, ``../``,
``~``); anything else is a hub id (``org/name``) looked up in the local Hugging Face cache only,
never downloaded: rollstream runs offline, so a hub model must be fetched beforehand
(``hf download org/name``). The cache is ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``~/.cache/huggingface/hub``, read when called (not when imported).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from rollstream.exceptions import ConfigError

# The weight layouts transformers' from_pretrained reads, single file or sharded (an index naming
# its shard files).
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# A fast tokenizer (tokenizer.json), a sentencepiece model, or a BPE vocabulary.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
# Every prompt is chat-templated (rollstream.policy.chat), so the template is
# required: a file of its own, or the ``chat_template`` key of tokenizer_config.json.
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


BUNDLED_MODEL_NAME = "smollm2-135m-instruct"


def default_cache_dir() -> Path:
    """The bundled model's fp32 folder (built on first use by rollstream.policy.model):
    ``$ROLLSTREAM_MODEL_CACHE`` or ``~/.cache/rollstream/models/smollm2-135m-instruct``."""
    env = os.environ.get("ROLLSTREAM_MODEL_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "rollstream" / "models" / BUNDLED_MODEL_NAME


def is_built_model_cache(folder: Path) -> bool:
    """Whether the bundled model's cache ``folder`` is complete (config, weights, tokenizer)."""
    # The folder only ever appears by an atomic rename of a fully written temp folder, but a
    # hand-made or truncated one is possible.
    return (folder / "config.json").is_file() and (
        (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file()
    ) and (folder / "tokenizer_config.json").is_file()


def hf_hub_cache() -> Path:
    """The local Hugging Face hub cache folder, from the environment at call time."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def missing_model_files(folder: Path) -> list[str]:
    """What ``folder`` lacks to be a loadable model folder, in words (empty: complete): its
    ``config.json``, weights (see WEIGHT_FILES / WEIGHT_INDEXES, with every shard an index names),
    a tokenizer (TOKENIZER_FILES) and its chat template (CHAT_TEMPLATE_FILES)."""
    missing = []
    if not (folder / "config.json").is_file():
        missing.append("config.json")
    indexes = [folder / name for name in WEIGHT_INDEXES if (folder / name).is_file()]
    if indexes:
        try:
            shards = sorted(set(json.loads(indexes[0].read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            missing.append(f"a readable weight index ({indexes[0].name}: {type(exc).__name__}: {exc})")
        else:
            absent = [s for s in shards if not (folder / s).is_file()]
            if absent:
                missing.append(f"weight shards {absent[:3]}{' ...' if len(absent) > 3 else ''} named by {indexes[0].name}")
    elif not any((folder / name).is_file() for name in WEIGHT_FILES):
        missing.append(f"weights (one of {', '.join(WEIGHT_FILES + WEIGHT_INDEXES)})")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        missing.append(f"a tokenizer (one of {', '.join(TOKENIZER_FILES)})")
    elif not _has_chat_template(folder):
        missing.append(f"a chat template ({' or '.join(CHAT_TEMPLATE_FILES)}, or chat_template in "
                       "tokenizer_config.json): every prompt is chat-templated")
    return missing


def _has_chat_template(folder: Path) -> bool:
    if any((folder / name).is_file() for name in CHAT_TEMPLATE_FILES):
        return True
    try:
        return bool(json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or name in (".", "..") or name.count("/") > 1


def _from_hub_cache(name: str) -> Path:
    # huggingface_hub resolves refs/main -> snapshots/<rev> for us, strictly offline.
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    cache = hf_hub_cache()
    try:
        return Path(snapshot_download(name, cache_dir=cache, local_files_only=True))
    except HFValidationError as exc:
        raise ConfigError(f"{name!r} is neither an existing folder nor a valid hub id ({exc})") from exc
    except (LocalEntryNotFoundError, FileNotFoundError, OSError) as exc:
        raise ConfigError(
            f"{name!r} is not a folder, and hub id {name!r} is not in the local Hugging Face cache {cache} "
            f"(rollstream never downloads: fetch it first with `hf download {name}`, or give a folder)"
        ) from exc


def resolve_model_path(name: str) -> Path:
    """The complete model folder ``name`` names: a local folder, or a hub id's snapshot in the
    local Hugging Face cache (offline). Raises ConfigError saying where it looked and what is
    missing (no such folder; not in the cache; no config.json, weights or tokenizer)."""
    if not name or not name.strip():
        raise ConfigError("model path is empty")
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"model path {str(path.absolute())!r} is a file; expected a Hugging Face model folder")
        folder = path
    elif _looks_like_path(name):
        raise ConfigError(f"model folder {str(path.absolute())!r} does not exist")
    else:
        folder = _from_hub_cache(name)
    missing = missing_model_files(folder)
    if missing:
        raise ConfigError(f"model folder {str(folder.absolute())!r} is incomplete, it lacks: {'; '.join(missing)}")
    return folder


def check_model_path(name: str | None) -> str | None:
    """Pydantic validator body: ``name`` unchanged when None or resolvable, else ValueError with
    resolve_model_path's message (pydantic prefixes the field path)."""
    if name is not None:
        try:
            resolve_model_path(name)
        except ConfigError as exc:
            raise ValueError(str(exc)) from exc
    return name
