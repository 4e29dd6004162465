"""Publish a config's datasets to the prompts topic."""

from __future__ import annotations

from rollstream.config import AgenticConfig, RLVRConfig
from rollstream.data import interleave, load_prompts
from rollstream.kafka.clients import make_producer
from rollstream.kafka.topics import Topics
from rollstream.runtime import now_ms
from rollstream.schemas import encode


def config_prompts(config: RLVRConfig) -> list[dict]:
    """Every dataset's prompts: validation first (an unfiltered estimate before training, never
    starved by a finished training run), then training prompts interleaved by
    domain_interleave_probs."""
    train: dict[str, list[dict]] = {}
    val: list[dict] = []
    for ds in config.datasets:
        prompts = load_prompts(ds.source, ds.domain, ds.num_samples, config.seed, mode=ds.mode, config=ds.config or None)
        if ds.mode == "val":  # own ids: a val prompt must never share a transaction with a train one
            val.extend({**p, "prompt_id": f"val/{p['prompt_id']}"} for p in prompts)
        else:
            train.setdefault(ds.domain, []).extend(prompts)
    probs = {d: config.domain_interleave_probs.get(d, 1.0) for d in train}
    mixed = interleave(train, probs, config.seed) if train else []
    return val + mixed


def produce_prompts(config: RLVRConfig, bootstrap: str, prompts: list[dict] | None = None) -> int:
    topics = Topics(config.kafka.topic_prefix)
    producer = make_producer(bootstrap)
    records = config_prompts(config) if prompts is None else prompts
    for record in records:
        producer.send(topics.prompts, key=record["prompt_id"].encode(),
                      value=encode({**record, "created_ms": now_ms()}, "Prompt"))
    producer.flush()
    producer.close()
    return len(records)


def start_env_groups(config: AgenticConfig, bootstrap: str) -> int:
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
