"""Publish a config's datasets (or any prompts) to the prompts topic, ended by a ``PromptsEnd``."""

from __future__ import annotations

from typing import Iterable

from rollstream.config import AgenticConfig, DatasetConfig, RLVRConfig
from rollstream.data import dataset_prompts, interleave
from rollstream.kafka.admin import create_pipeline_topics
from rollstream.kafka.cluster import Bootstrap
from rollstream.kafka.clients import make_producer
from rollstream.kafka.topics import Topics
from rollstream.runtime import now_ms
from rollstream.schemas import encode
from rollstream.schemas.records import PROMPTS_END_KEY, prompts_end


def config_prompts(config: RLVRConfig, datasets: list[DatasetConfig] | None = None) -> list[dict]:
    """Every dataset's prompts (``datasets``: these instead of the config's): the training prompts
    interleaved by domain_interleave_probs (a file's rows may name several domains), with the
    validation prompts after the first ``max_running_prompts`` of them. The admission takes that
    many train prompts at once, then the validation ones (they take no train slot): validation
    still comes before any step trains (the estimate of the initial weights) and is never starved
    by a finished run, while the first batch's requests reach the generation workers first."""
    train: dict[str, list[dict]] = {}
    val: list[dict] = []
    for ds in config.datasets if datasets is None else datasets:
        for prompt in dataset_prompts(ds, config.seed):
            if ds.mode == "val":
                val.append(prompt)
            else:
                train.setdefault(prompt["domain"], []).append(prompt)
    probs = {d: config.domain_interleave_probs.get(d, 1.0) for d in train}
    mixed = interleave(train, probs, config.seed) if train else []
    first = config.max_running_prompts
    return mixed[:first] + val + mixed[first:]


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
