"""Two training steps of the main job's model on the real broker: the trainer checkpoints and
publishes each policy version, and the generation worker loads it before its next requests and
stamps its responses with it. Generation runs in bfloat16 and training in float32, so the
train-inference correction sees a real mismatch."""

from __future__ import annotations

import threading

import pytest
import torch

from rollstream.kafka.context import StageContext
from rollstream.kafka.clients import make_producer
from rollstream.kafka.event_worker import EventWorker
from rollstream.policy.versions import PolicyFollower, PolicyVersionWatcher
from rollstream.schemas import encode
from rollstream.schemas.records import payload_ref, response_summary
from rollstream.tools.readback import read_topic, read_values
from rollstream.trainer.checkpoint import CheckpointStore
from rollstream.trainer.batch_builder import BatchBuilder
from rollstream.trainer.corrections import parse_correction_config
from rollstream.trainer.policy_trainer import PolicyTrainer, TrainSettings
from rollstream.trainer.publisher import PolicyPublisher, version_of
from rollstream.inference.engine import SamplingParams
from rollstream.inference.transformers_engine import TransformersBackend
from rollstream.workers.generation import GenerationWorker

from .harness import wait_for

pytestmark = pytest.mark.integration

SAMPLES = 2


def request(prompt_id: str, text: str) -> dict:
    return {"prompt_id": prompt_id, "domain": "math", "mode": "train", "prompt": text, "ground_truth": "4",
            "round": 0, "num_return_sequences": SAMPLES, "sample_offset": 0, "seed": 11}


def accepted_group(prompt_id: str, responses: list[tuple[dict, dict]]) -> dict:
    """The aggregator's accepted Group for ``responses`` ((Response, its PayloadRef) as the
    generation worker wrote them): sample 0 rewarded 1, the others 0; members name their tokens
    by reference."""
    responses = sorted(responses, key=lambda r: r[0]["sample_index"])
    return {
        "group_key": prompt_id, "kind": "rlvr", "prompt_id": prompt_id, "domain": "math", "mode": "train",
        "accepted": True, "reason": "accepted", "decision_values": {}, "filter_config": "{}",
        "filter_config_hash": "", "policy_version": min(r["policy_version"] for r, _ in responses), "rounds": 1,
        "responses_generated": len(responses), "prompt": responses[0][0]["prompt"], "ground_truth": "4",
        "responses": [{"response": response_summary(r), "response_level_reward": float(r["sample_index"] == 0),
                       "scores": {}, "meta": {}, "reward_error": None, "reward_ms": 0.0, "payload": ref}
                      for r, ref in responses],
        "created_ms": 0,
    }


def written_responses(bootstrap: str, topic: str, prompt_id: str) -> list[tuple[dict, dict]]:
    """The Responses of ``prompt_id`` on the payload topic with their PayloadRefs."""
    return [(r.value, payload_ref(r.topic, r.partition, r.offset, len(r.raw))) for r in read_topic(bootstrap, topic)
            if r.schema == "Response" and r.value["prompt_id"] == prompt_id]


def test_two_steps_publish_versions_that_the_generation_worker_loads_and_stamps(kafka_broker, topic_factory, tmp_path):
    topics = topic_factory(partitions=1)
    backend = TransformersBackend(dtype=torch.bfloat16, max_num_seqs=8)
    follower = PolicyFollower(PolicyVersionWatcher(kafka_broker, topics), backend)
    generation = EventWorker(
        StageContext(kafka_broker, topics, "generation"), input_topic=topics.generation_requests,
        group_id=f"{topics.prefix}gen", expected_schema="GenerationRequest", max_batch=8,
        handler=GenerationWorker(backend, SamplingParams(temperature=1.0, max_new_tokens=8), topics, policy=follower))
    thread = threading.Thread(target=generation.run, daemon=True)
    thread.start()
    correction = parse_correction_config({"filters": [{"enabled": True, "agg_type": "token", "ratio_enabled": True,
                                                       "ratio_low": 0.9, "ratio_high": 1.1}]})
    store = CheckpointStore(tmp_path / "checkpoints")
    trainer = PolicyTrainer(TrainSettings(lr=1e-4, micro_batch_size=2), correction, checkpoints=store)
    builder = BatchBuilder(kafka_broker, topics, rollout_batch_size=1, group_id=f"{topics.prefix}trainer",
                           manifest_path=tmp_path / "batches.jsonl", pad_token_id=backend.pad_id)
    publisher = PolicyPublisher(kafka_broker, topics)
    producer = make_producer(kafka_broker)
    reports, snapshots = [], []
    try:
        publisher.publish(0, -1, "", False)
        for step, text in enumerate(["What is 2 + 2?", "What is 3 + 1?"]):
            pid = f"q{step}"
            producer.send(topics.generation_requests, key=pid.encode(), value=encode(request(pid, text), "GenerationRequest"))
            producer.flush()

            def responses() -> list[tuple[dict, dict]]:
                return written_responses(kafka_broker, topics.responses, pid)
            wait_for(lambda: len(responses()) == SAMPLES, timeout=120, what=f"responses of {pid}")
            written = responses()
            assert {r["policy_version"] for r, _ in written} == {step}  # v0, then the trained v1
            producer.send(topics.groups_accepted, key=pid.encode(), value=encode(accepted_group(pid, written), "Group"))
            producer.flush()
            batch = builder.next_batch(timeout_s=60)
            assert batch is not None and batch.group_keys == [pid]
            # the batch holds exactly the tokens the worker generated, read back by reference
            by_index = {r["sample_index"]: r for r, _ in written}
            for row, index in enumerate(batch.sample_index):
                n = int(batch.response_lengths[row])
                assert batch.response_ids[row, :n].tolist() == by_index[index]["response_token_ids"].tolist()
                assert torch.equal(batch.infer_logprobs[row, :n], torch.from_numpy(by_index[index]["infer_logprobs"].copy()))
            reports.append(trainer.train(batch))
            snapshots.append(trainer.model.model.embed_tokens.weight.detach().clone())
            entry = builder.commit(batch, reports[-1])
            publisher.publish_step(entry)
            publisher.publish(*version_of(entry))
        # the worker loaded v1 (the checkpoint after step 0) before generating q1, cast to bf16
        assert follower.loaded == 1 and backend.policy_version == 1
        assert torch.equal(backend.model.model.embed_tokens.weight, snapshots[0].to(torch.bfloat16))
        assert not torch.equal(snapshots[0], snapshots[1])
    finally:
        generation.stop()
        thread.join(30)
        for closable in (producer, publisher, builder, follower):
            closable.close()

    assert [r["policy_version"] for r in reports] == [1, 2]
    assert [r["generator_versions"] for r in reports] == [[0], [1]]
    assert [r["policy_lag_max"] for r in reports] == [0, 0]  # on-policy: trained by the version that generated
    assert all(not r["skipped"] and r["loss"] == r["loss"] for r in reports)
    # bf16 generation vs fp32 training: the ratios are not all 1
    assert any(r["diff_means"]["token"] != 0.0 for r in reports)
    assert all(0.0 < r["final_mask_mean"] <= 1.0 for r in reports)
    assert set(reports[0]["pass_rates"]) == {"actor/train_infer_token_ratio_mask_mean@sum"}
    published = read_values(kafka_broker, topics.policy_versions)
    assert [(p["version"], p["step"], p["trained"]) for p in published] == [(0, -1, False), (1, 0, True), (2, 1, True)]
    assert [p["checkpoint"] for p in published[1:]] == [str(store.path_of(1)), str(store.path_of(2))]
    assert store.versions() == [1, 2]
