"""The payload plane on the real broker: token arrays written once, read back by
reference, only for the groups the trainer trains.

- a 16 x 16,384-token group reaches a trainer batch bit-identical to what was generated;
- a rejected group's payloads are never fetched;
- an expired reference (records deleted below the log start offset) rejects its group
  ``payload_expired`` and the builder goes on;
- PayloadFetcher itself: partitions, non-adjacent offsets, duplicates, expiry, two topics;
- per-token extras (``routed_experts``) arrive in the batch exactly, zero-padded.
"""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest
from kafka import KafkaAdminClient
from kafka.admin import ConfigResource, ConfigResourceType
from kafka.structs import TopicPartition

from rollstream.config.base import KafkaConfig
from rollstream.kafka.admin import create_topics
from rollstream.kafka.clients import make_producer, reader_consumer
from rollstream.kafka.payloads import PayloadFetcher, PayloadWriter, ref_key
from rollstream.kafka.topics import Topics
from rollstream.observability.metrics import process_metrics
from rollstream.schemas import decode, encode
from rollstream.schemas.packed import packed_array
from rollstream.schemas.records import is_payload_ref, payload_ref
from rollstream.trainer.batch_builder import BatchBuilder
from rollstream.trainer.retention import PayloadRetention

from ..trainer import records
from .test_trainer_consumer import read_all

pytestmark = pytest.mark.integration

CONFIG = KafkaConfig()
WAIT_S = 60.0
GROUP, TOKENS, PROMPT = 16, 16_384, 64


@pytest.fixture
def topics(kafka_broker) -> Topics:
    """Fresh topics, one partition each, the payload topics configured as a deployment's."""
    return make_topics(kafka_broker, 1)


def make_topics(bootstrap: str, partitions: int) -> Topics:
    topics = Topics(f"t-{uuid.uuid4().hex[:8]}.")
    create_topics(bootstrap, topics.all(partitions), configs=topics.topic_configs(CONFIG))
    return topics


def payload_producer(bootstrap: str):
    return make_producer(bootstrap, max_request_size=CONFIG.max_message_bytes, compression_type=CONFIG.compression_type)


def generated(key: str, n: int = GROUP, tokens: int = TOKENS, seed: int = 0, extras=None) -> list[dict]:
    """``n`` Responses of prompt ``key`` as a generation worker makes them: random int32 token ids
    over the whole non-negative int32 range, random float32 logprobs; ``extras(i, tokens)``: the
    extras of response i."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 2**31 - 1, size=PROMPT, dtype=np.int32)
    out = []
    for i in range(n):
        ids = rng.integers(0, 2**31 - 1, size=tokens, dtype=np.int32)
        logprobs = -rng.exponential(2.0, size=tokens).astype(np.float32)
        out.append(records.response_payload(key, i, prompt, ids, logprobs,
                                            extras=extras(i, tokens) if extras is not None else None))
    return out


def write_group(bootstrap: str, topics: Topics, responses: list[dict], *, accepted: bool = True,
                rewards=None, stamped: tuple[int, int] | None = None) -> dict:
    """The real way: Responses to ``responses`` (PayloadWriter), RewardedResponses naming them to
    ``responses.rewarded``, then the Group of those members to groups.accepted (or
    groups.rejected). ``stamped``: the payloads' and the Group's record timestamps (epoch ms; by
    default the producer's clock). Returns the Group."""
    producer = payload_producer(bootstrap)
    try:
        key = responses[0]["prompt_id"]
        if stamped is None:
            refs = PayloadWriter(producer).write([(topics.responses, key, encode(r, "Response")) for r in responses])
        else:
            sent = [producer.send(topics.responses, key=key.encode(), value=encode(r, "Response"),
                                  timestamp_ms=stamped[0]) for r in responses]
            refs = [payload_ref(m.topic, m.partition, m.offset, 0) for m in (f.get(timeout=30) for f in sent)]
        rewards = rewards or [float(i % 2) for i in range(len(responses))]
        members = [records.rewarded(r, reward, ref) for r, reward, ref in zip(responses, rewards, refs)]
        for member in members:
            producer.send(topics.responses_rewarded, key=key.encode(), value=encode(member, "RewardedResponse"))
        group = records.rlvr_group(key, members, accepted=accepted)
        producer.send(topics.groups_accepted if accepted else topics.groups_rejected, key=key.encode(),
                      value=encode(group, "Group"), timestamp_ms=None if stamped is None else stamped[1])
        producer.flush()
        return group
    finally:
        producer.close()


def recording(fetcher: PayloadFetcher) -> list:
    """Record every ``Fetched`` that ``fetcher.fetch`` hands back (the real fetch runs)."""
    handed = []
    real = fetcher.fetch

    def fetch(refs, **kwargs):
        result = real(refs, **kwargs)
        handed.append(result)
        return result

    fetcher.fetch = fetch
    return handed


def builder_for(bootstrap: str, topics: Topics, size: int, **kwargs) -> BatchBuilder:
    return BatchBuilder(bootstrap, topics, size, group_id=f"{topics.prefix}trainer",
                        max_message_bytes=CONFIG.max_message_bytes, **kwargs)


def test_a_long_accepted_group_reaches_the_batch_bit_identical_and_a_rejected_one_is_never_fetched(
        kafka_broker, topics):
    accepted_responses = generated("acc", seed=1)
    rejected_responses = generated("rej", seed=2)
    # the rejected group's payloads sit on the same partition, right after the accepted ones
    accepted = write_group(kafka_broker, topics, accepted_responses)
    rejected = write_group(kafka_broker, topics, rejected_responses, accepted=False)
    rejected_keys = {ref_key(rr["payload"]) for rr in rejected["responses"]}

    # the decision plane stays small: a RewardedResponse is a summary and a reference
    rewarded = read_all(kafka_broker, topics.responses_rewarded, 2 * GROUP)
    assert all(is_payload_ref(rr["payload"]) for rr in rewarded)
    assert max(len(encode(rr, "RewardedResponse")) for rr in rewarded) < 1024
    assert rewarded[0]["response"]["response_length"] == TOKENS

    with builder_for(kafka_broker, topics, 1) as builder:
        handed = recording(builder.fetcher)
        batch = builder.next_batch(timeout_s=WAIT_S)
        assert batch is not None and batch.group_keys == ["acc"]
        assert batch.response_ids.shape == (GROUP, TOKENS) and batch.prompt_ids.shape == (GROUP, PROMPT)
        for row, index in enumerate(batch.sample_index):
            sent = accepted_responses[index]
            ids = batch.response_ids[row].numpy()
            assert ids.dtype == np.int64 and np.array_equal(ids, sent["response_token_ids"].astype(np.int64))
            got = batch.infer_logprobs[row].numpy()
            assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), sent["infer_logprobs"].view(np.uint32))
            assert np.array_equal(batch.prompt_ids[row].numpy(), sent["prompt_token_ids"].astype(np.int64))
        assert batch.response_mask.sum().item() == GROUP * TOKENS
        assert batch.response_level_rewards.tolist() == [float(i % 2) for i in range(GROUP)]
        entry = builder.commit(batch)
        metrics = builder.metrics()

    assert entry["offsets"] == {"0": 1} and entry["group_keys"] == ["acc"]
    assert builder.fetcher.fetched == GROUP  # exactly the accepted group's records
    assert metrics["trainer/batch/payload_records_fetched"] == GROUP
    assert metrics["trainer/batch/payload_bytes_fetched"] == sum(rr["payload"]["size_bytes"] for rr in accepted["responses"])
    assert metrics["trainer/batch/payload_fetch_seconds"] > 0
    handed_keys = {key for result in handed for key in result.values}
    assert handed_keys == {ref_key(rr["payload"]) for rr in accepted["responses"]}
    assert not handed_keys & rejected_keys


def test_an_expired_reference_rejects_its_group_payload_expired_and_the_builder_goes_on(kafka_broker, topics):
    short = dict(n=4, tokens=32)
    expired = write_group(kafka_broker, topics, generated("old", seed=3, **short))
    # retention: the first two of old's four payloads are deleted (log start offset moves to 2)
    offsets = [rr["payload"]["offset"] for rr in expired["responses"]]
    assert offsets == [0, 1, 2, 3]
    admin = KafkaAdminClient(bootstrap_servers=kafka_broker)
    try:
        admin.delete_records({TopicPartition(topics.responses, 0): 2}, timeout_ms=30_000)
    finally:
        admin.close()
    b = generated("b", seed=4, **short)
    write_group(kafka_broker, topics, b)
    write_group(kafka_broker, topics, generated("c", seed=5, **short))

    def rejections() -> float:
        return process_metrics().registry.get_sample_value(
            "rollstream_rejections_total", {"unit": "trainer", "reason": "payload_expired"}) or 0.0
    before = rejections()

    with builder_for(kafka_broker, topics, 2) as builder:
        batch = builder.next_batch(timeout_s=WAIT_S)  # old goes, b and c fill the batch
        assert batch is not None and batch.group_keys == ["b", "c"]
        assert batch.response_ids[0].tolist() == b[0]["response_token_ids"].tolist()
        assert builder.payload_expired_groups == 1
        assert builder.metrics()["trainer/batch/payload_expired_groups"] == 1
        # one fetch per try: old's two live payloads were read with b's (old, b), then c's alone
        assert builder.fetcher.fetched == 2 + 4 + 4 and builder.fetcher.expired == 2
        entry = builder.commit(batch)
    assert entry["offsets"] == {"0": 3}  # old's offset is done: a restart never sees it again
    assert rejections() == before + 1

    (rejection,) = read_all(kafka_broker, topics.groups_rejected, 1)
    assert (rejection["group_key"], rejection["accepted"], rejection["reason"]) == ("old", False, "payload_expired")
    assert rejection["decision_values"] == {"payload_expired": 2.0, "members": 4.0}
    assert [ref_key(rr["payload"]) for rr in rejection["responses"]] == [ref_key(rr["payload"])
                                                                         for rr in expired["responses"]]

    with builder_for(kafka_broker, topics, 1) as again:
        assert again.next_batch(timeout_s=2) is None and again.consumed == 0  # nothing left, nothing redone


def test_the_trainer_deletes_what_no_group_needs_and_never_a_payload_a_held_group_names(kafka_broker, topics):
    """Payload retention follows the trainer: the topic never deletes by time (retention.ms -1);
    after a commit the builder deletes the payloads stamped before the time cut (here now - 300 s:
    no upstream stage, no keep_ms) but never one a group it holds names. On ``responses``: a
    (accepted, stamped 600 s ago) 0-3, r_old (rejected, 590 s) 4-7, b (accepted, 500 s) 8-11, r_new
    (rejected, 100 s) 12-15, c (accepted, 90 s) 16-19. (They were written before the builder
    started, so its first fetch reads all three accepted groups.)"""
    now = int(time.time() * 1000)
    for n, (key, age_s, accepted) in enumerate([("a", 600, True), ("r_old", 590, False), ("b", 500, True),
                                                 ("r_new", 100, False), ("c", 90, True)]):
        stamp = now - age_s * 1000
        write_group(kafka_broker, topics, generated(key, seed=n, n=4, tokens=8), accepted=accepted,
                    stamped=(stamp, stamp + 5_000))
    retention = PayloadRetention(keep_ms=0, completion_ms=300_000, readers=(), every_s=0.0, skew_ms=0)
    responses = TopicPartition(topics.responses, 0)
    starts = []
    with builder_for(kafka_broker, topics, 1, payload_retention=retention) as builder:
        for key in "abc":
            batch = builder.next_batch(timeout_s=WAIT_S)
            assert batch.group_keys == [key] and builder.payload_expired_groups == 0
            builder.commit(batch)
            starts.append(log_start(kafka_broker, responses))
        pruned = builder.metrics()["trainer/batch/payload_records_pruned"]
    # after a: b (8) is held; after b: the time cut (r_new, 12) and c (16); after c: the time cut
    assert (starts, pruned) == ([8, 12, 12], 12)
    assert configs_of(kafka_broker, topics.responses)["retention.ms"] == "-1"


def configs_of(bootstrap: str, topic: str) -> dict[str, str]:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        described = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)])["topic"][topic]
    finally:
        admin.close()
    return {k: v["value"] for k, v in described.items()}


def log_start(bootstrap: str, tp: TopicPartition) -> int:
    consumer = reader_consumer(bootstrap)
    try:
        return consumer.beginning_offsets([tp])[tp]
    finally:
        consumer.close()


def test_payload_fetcher_reads_exactly_the_named_records(kafka_broker):
    topics = make_topics(kafka_broker, 3)
    producer = payload_producer(kafka_broker)
    try:
        writer = PayloadWriter(producer)
        items = [(topics.responses, f"p{i}", encode(records.response_payload(f"p{i}", 0, [1], [i], [-0.5]), "Response"))
                 for i in range(30)]
        refs = writer.write(items)
        traj = records.trajectory_payload(0, [records.turn([1], [2], [-1.0])], [1], 1.0, group_id=7)
        (traj_ref,) = writer.write([(topics.trajectories, "7", encode(traj, "Trajectory"))])
    finally:
        producer.close()
    by_partition: dict[int, list[dict]] = {}
    for ref in refs:
        by_partition.setdefault(ref["partition"], []).append(ref)
    assert len(by_partition) == 3 and all(len(v) >= 3 for v in by_partition.values())  # spread by key
    value_of = {ref_key(ref): item[2] for ref, item in zip(refs, items)}

    # every other record of every partition (non-adjacent offsets), one named twice, plus a
    # trajectory from the other payload topic
    wanted = [ref for part in by_partition.values() for ref in part[::2]]
    with PayloadFetcher(kafka_broker, CONFIG.max_message_bytes) as fetcher:
        got = fetcher.fetch(wanted + [wanted[0], traj_ref])
        assert set(got.values) == {ref_key(r) for r in wanted} | {ref_key(traj_ref)}
        assert all(got.values[ref_key(r)] == value_of[ref_key(r)] for r in wanted)
        assert decode(got.values[ref_key(traj_ref)])[1]["group_id"] == 7
        assert got.expired == {}
        assert fetcher.fetched == len(wanted) + 1  # the duplicate is read and counted once
        assert fetcher.fetched_bytes == sum(len(value_of[ref_key(r)]) for r in wanted) + traj_ref["size_bytes"]

        # the same fetcher again (partitions read to the end last time), in another order
        again = fetcher.fetch(list(reversed(refs)))
        assert again.values == value_of and fetcher.fetched == len(wanted) + 1 + len(refs)

        # references outside the log: beyond the end, and (after deletion) below the start
        last = by_partition[0][-1]
        beyond = payload_ref(topics.responses, 0, last["offset"] + 5)
        admin = KafkaAdminClient(bootstrap_servers=kafka_broker)
        try:
            admin.delete_records({TopicPartition(topics.responses, 0): 1}, timeout_ms=30_000)
        finally:
            admin.close()
        first = by_partition[0][0]
        assert first["offset"] == 0
        result = fetcher.fetch([first, beyond, by_partition[0][1]])
        assert set(result.expired) == {ref_key(first), ref_key(beyond)}
        assert "below the log start offset 1" in result.expired[ref_key(first)]
        assert "at or after the log end offset" in result.expired[ref_key(beyond)]
        assert set(result.values) == {ref_key(by_partition[0][1])}
        assert fetcher.expired == 2
        assert fetcher.fetch([]).values == {}


def test_routed_experts_reach_the_batch_exactly_and_zero_padded(kafka_broker, topics):
    layers, top_k = 4, 2
    rng = np.random.default_rng(7)
    lengths = [40, 17, 33]
    routed = [rng.integers(0, 256, size=(n, layers, top_k)).astype(np.uint8) for n in lengths]

    def responses_with_extras(key):
        out = []
        for i, n in enumerate(lengths):
            resp = generated(key, n=1, tokens=n, seed=10 + i)[0]
            resp["sample_index"] = i
            resp["extras"] = {"routed_experts": packed_array(routed[i])}
            out.append(resp)
        return out

    write_group(kafka_broker, topics, responses_with_extras("moe"), rewards=[1.0, 0.0, 0.5])
    write_group(kafka_broker, topics, generated("dense", n=2, tokens=8, seed=20))
    with builder_for(kafka_broker, topics, 1) as builder:
        batch = builder.next_batch(timeout_s=WAIT_S)
        assert batch.group_keys == ["moe"]
        experts = batch.extras["routed_experts"]
        assert experts.shape == (3, max(lengths), layers, top_k) and str(experts.dtype) == "torch.uint8"
        for row, index in enumerate(batch.sample_index):
            n = lengths[index]
            assert np.array_equal(experts[row, :n].numpy(), routed[index])
            assert not experts[row, n:].any()  # zero padding
        builder.commit(batch)
        dense = builder.next_batch(timeout_s=WAIT_S)
        assert dense.group_keys == ["dense"] and dense.extras == {}
        builder.commit(dense)


def test_a_group_whose_extras_shape_differs_from_the_batch_is_dead_lettered_and_the_batch_fills(
        kafka_broker, topics):
    def with_experts(key, layers, seed):
        out = generated(key, n=2, tokens=6, seed=seed)
        for resp in out:
            resp["extras"] = {"routed_experts": packed_array(np.ones((6, layers, 2), np.uint8))}
        return out

    write_group(kafka_broker, topics, with_experts("four-layers", 4, 30))
    write_group(kafka_broker, topics, with_experts("three-layers", 3, 31))  # one tensor cannot hold both
    write_group(kafka_broker, topics, with_experts("four-again", 4, 32))
    with builder_for(kafka_broker, topics, 2) as builder:
        batch = builder.next_batch(timeout_s=WAIT_S)
        assert batch.group_keys == ["four-layers", "four-again"]
        assert tuple(batch.extras["routed_experts"].shape) == (4, 6, 4, 2)
        builder.commit(batch)
        assert builder.dead_lettered == 1
    [dead] = read_all(kafka_broker, topics.dead_letter, 1)
    assert dead["reason"] == "invalid_event" and "(3, 2)" in dead["error"] and "(4, 2)" in dead["error"]
