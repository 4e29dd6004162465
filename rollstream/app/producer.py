"""Publish a config's datasets (or any prompts) to the prompts topic, ended by a ``PromptsEnd``."""

from __future__ import annotations

import logging

from rollstream.config import AgenticConfig, DatasetConfig, RLVRConfig
from rollstream.data import dataset_prompts, interleave, publish_end, publish_prompts
from rollstream.kafka.admin import create_pipeline_topics
from rollstream.kafka.cluster import Bootstrap
from rollstream.kafka.clients import make_producer
from rollstream.kafka.topics import Topics
from rollstream.runtime import now_ms
from rollstream.schemas import encode

log = logging.getLogger(__name__)


def config_prompts(config: RLVRConfig, datasets: list[DatasetConfig] | None = None) -> list[dict]:
    """Every dataset's prompts (``datasets``: these instead of the config's): the training prompts
    interleaved by domain_interleave_probs (a file's rows may name several domains), with the
    validation prompts after the train prompts of the steps the initial weights generate
    (``val_after``). The admission reads the topic in order and admits a round without a slot,
    so those steps' requests reach the generation workers before the round's samples, and the
    round is still admitted before any version but the first can be published."""
    train: dict[str, list[dict]] = {}
    val: list[dict] = []
    for ds in config.datasets if datasets is None else datasets:
        for prompt in dataset_prompts(ds, config.seed):
            if ds.mode == "val":
                val.append(prompt)
            else:
                train.setdefault(prompt["domain"], []).append(prompt)
    leaked = leaked_validation([p for ps in train.values() for p in ps], val)
    if leaked:
        log.warning("%d of %d validation prompts are also train prompts (e.g. %s): their accuracy measures "
                    "memory, not generalisation. Give the validation datasets other sources or seeds (a "
                    "reasoning-gym task seeds item i with seed + i: keep the seeds further apart than num_samples).",
                    len(leaked), len(val), leaked[0])
    probs = {d: config.domain_interleave_probs.get(d, 1.0) for d in train}
    mixed = interleave(train, probs, config.seed) if train else []
    first = val_after(config)
    return mixed[:first] + val + mixed[first:]


def leaked_validation(train: list[dict], val: list[dict]) -> list[str]:
    """The ``prompt_id`` of each validation prompt whose text (``prompt`` and ``messages``) is
    also a train prompt's, in ``val``'s order."""
    def text(p: dict) -> tuple:
        return p["prompt"], tuple((m["role"], m["content"]) for m in p.get("messages") or ())

    seen = {text(p) for p in train}
    return [p["prompt_id"] for p in val if text(p) in seen]


def val_after(config: RLVRConfig) -> int:
    """How many train prompts precede the validation prompts on ``prompts``: the first step's
    ``rollout_batch_size``, and the second step's too unless ``max_staleness`` is 0 or
    ``max_steps`` is 1. Version 1 exists only once the first batch is trained, so the second
    step's prompts (admitted when the first batch is full; each step takes at least
    ``rollout_batch_size`` of them) and the round after them come from version 0's time, and
    the step trained right after the first one does not wait behind the round. With
    ``max_staleness: 0`` the second step waits for version 1, which must not generate round 0;
    with ``max_steps: 1`` no second step is admitted, which would starve the round."""
    steps = 1 if config.max_staleness == 0 or config.max_steps == 1 else 2
    return steps * config.rollout_batch_size


def produce_prompts(config: RLVRConfig, bootstrap: Bootstrap, prompts: list[dict] | None = None, *,
                    end: bool = True, producer_name: str = "rollstream") -> int:
    """Publish ``prompts`` (default: the config's datasets, ``config_prompts``), then a
    ``PromptsEnd`` unless ``end`` is False; returns the prompts published. A config with
    ``datasets: []`` and no ``prompts`` publishes nothing, no marker either: its prompts come from
    outside (``rollstream produce-prompts --file``, ``rollstream.client``), which end the data."""
    records = config_prompts(config) if prompts is None else prompts
    if prompts is None and not config.datasets:
        return 0
    topics = Topics(config.kafka.topic_prefix)
    create_pipeline_topics(bootstrap, config.kafka, only=("prompts",))  # one partition: the marker comes last
    producer = make_producer(bootstrap)
    try:
        sent = publish_prompts(producer, topics, records)
        if end:
            publish_end(producer, topics, sent, producer_name)
        producer.flush()
    finally:
        producer.close()
    return sent


def start_env_groups(config: AgenticConfig, bootstrap: Bootstrap) -> int:
    """Send a ``start`` GroupCommand for every env group of every mode (validation first); the
    group queue opens each one once, so sending again is harmless. Returns the number sent."""
    topics = Topics(config.kafka.topic_prefix)
    producer = make_producer(bootstrap)
    managers = config.env_managers()
    sent = 0
    for mode in sorted(managers, key=lambda m: m != "val"):
        for group_id in range(managers[mode].num_env_groups):
            record = {"command": "start", "mode": mode, "group_id": group_id, "created_ms": now_ms()}
            producer.send(topics.episodes_control, key=str(group_id).encode(), value=encode(record, "GroupCommand"))
            sent += 1
    producer.flush()
    producer.close()
    return sent
