"""Response aggregation + filters on the real broker (faust worker subprocesses, no model)."""

from __future__ import annotations

import pytest
from kafka.partitioner.default import murmur2

from rollstream.app.stages import Stage
from rollstream.kafka import names
from rollstream.kafka.clients import make_producer
from rollstream.kafka.payloads import PayloadFetcher, ref_key
from rollstream.schemas import decode, encode
from rollstream.tools.readback import read_values

from .harness import DOMAIN, publish_rewarded, response, start_stages, wait_for, wait_for_group, write_config

pytestmark = pytest.mark.integration

PARTITIONS = 4


def partition_of(key: str, n: int = PARTITIONS) -> int:
    return (murmur2(key.encode()) & 0x7FFFFFFF) % n


def same_partition_key(key: str, prefix: str) -> str:
    return next(f"{prefix}{i}" for i in range(1000) if partition_of(f"{prefix}{i}") == partition_of(key))


@pytest.fixture
def aggregator(kafka_broker, topic_factory, tmp_path):
    """Topics with 4 partitions and one aggregator worker; yields (topics, stage processes)."""
    topics = topic_factory(partitions=PARTITIONS)
    config = write_config(tmp_path, topics, PARTITIONS)
    stages = start_stages(config, kafka_broker, tmp_path / "logs", Stage.aggregator)
    yield topics, stages
    stages.close()


def test_group_emitted_only_when_complete_and_only_once(kafka_broker, aggregator):
    topics, stages = aggregator
    sentinel = same_partition_key("pA", "sentinel-")
    # three of four responses, then a complete sentinel group behind them in the same partition
    first = publish_rewarded(kafka_broker, topics,
                             [response("pA", i, reward=float(i == 0)) for i in range(3)]
                             + [response(sentinel, i, reward=float(i == 0)) for i in range(4)])
    wait_for(lambda: len(read_values(kafka_broker, topics.groups_accepted)) == 1, what="sentinel group", stages=stages)
    assert [g["prompt_id"] for g in read_values(kafka_broker, topics.groups_accepted)] == [sentinel]
    # the last response and a redelivery of every pA response
    second = publish_rewarded(kafka_broker, topics,
                              [response("pA", 3)] + [response("pA", i, reward=float(i == 0)) for i in range(4)]
                              + [response(sentinel + "x", i, reward=float(i == 1)) for i in range(4)])
    wait_for(lambda: len(read_values(kafka_broker, topics.groups_accepted)) == 3, what="three groups", stages=stages)
    groups = read_values(kafka_broker, topics.groups_accepted)
    pa = [g for g in groups if g["prompt_id"] == "pA"]
    assert len(pa) == 1
    assert [r["response"]["sample_index"] for r in pa[0]["responses"]] == [0, 1, 2, 3]
    assert [r["response_level_reward"] for r in pa[0]["responses"]] == [1.0, 0.0, 0.0, 0.0]
    assert pa[0]["decision_values"]["std"] == pytest.approx(0.5)
    assert pa[0]["filter_config_hash"] and "std_filter" in pa[0]["filter_config"]
    # the group names the first delivery of each response's payload (redeliveries are ignored)
    refs = [r["payload"] for r in pa[0]["responses"]]
    assert refs == [rec["payload"] for rec in first[:3]] + [second[0]["payload"]]
    assert all(ref["topic"] == topics.responses for ref in refs)
    with PayloadFetcher(kafka_broker) as fetcher:
        fetched = fetcher.fetch(refs)
    assert not fetched.expired
    payloads = [decode(fetched.values[ref_key(ref)])[1] for ref in refs]
    assert [(p["prompt_id"], p["sample_index"]) for p in payloads] == [("pA", i) for i in range(4)]
    assert [p["response_token_ids"].tolist() for p in payloads] == [[10, 11, 12, 13]] * 4
    assert [len(fetched.values[ref_key(ref)]) for ref in refs] == [ref["size_bytes"] for ref in refs]
    assert "prompt_token_ids" not in pa[0]
    outcomes = read_values(kafka_broker, topics.prompt_outcomes)
    assert sorted(o["prompt_id"] for o in outcomes) == sorted(["pA", sentinel, sentinel + "x"])
    assert read_values(kafka_broker, topics.groups_rejected) == []


def test_replacements_ask_for_exactly_the_rejected_count(kafka_broker, aggregator):
    topics, stages = aggregator
    publish_rewarded(kafka_broker, topics, [
        response("pR", 0, reward=1.0), response("pR", 1, finish_reason="length"),
        response("pR", 2), response("pR", 3, finish_reason="length"),
    ])
    wait_for(lambda: len(read_values(kafka_broker, topics.generation_requests)) == 1, what="round 1 request", stages=stages)
    [req] = read_values(kafka_broker, topics.generation_requests)
    assert (req["prompt_id"], req["round"], req["num_return_sequences"], req["sample_offset"]) == ("pR", 1, 2, 4)
    publish_rewarded(kafka_broker, topics, [
        response("pR", 4, round_=1), response("pR", 5, round_=1, tokens=0),
    ])
    wait_for(lambda: len(read_values(kafka_broker, topics.generation_requests)) == 2, what="round 2 request", stages=stages)
    req2 = read_values(kafka_broker, topics.generation_requests)[1]
    assert (req2["round"], req2["num_return_sequences"], req2["sample_offset"]) == (2, 1, 6)
    assert req2["seed"] != req["seed"]
    publish_rewarded(kafka_broker, topics, [response("pR", 6, round_=2)])
    wait_for(lambda: read_values(kafka_broker, topics.groups_accepted), what="group", stages=stages)
    [group] = read_values(kafka_broker, topics.groups_accepted)
    assert [r["response"]["sample_index"] for r in group["responses"]] == [0, 2, 4, 6]
    assert (group["rounds"], group["responses_generated"]) == (3, 7)
    assert group["decision_values"]["rejected_responses/truncated"] == 2.0
    assert group["decision_values"]["rejected_responses/empty_response"] == 1.0


def test_screening_decides_from_the_first_samples_or_asks_for_the_rest(kafka_broker, topic_factory, tmp_path):
    """A screened domain (k = 2 of 4): a prompt whose 2 samples are equal is rejected
    screened_out from them, nothing more asked; a mixed one gets a round-1 request for the other
    2, and its group holds all 4 with the versions that generated each."""
    topics = topic_factory(partitions=PARTITIONS)
    rewards = {DOMAIN: {"reward_type": "gsm8k", "screening": {"samples": 2},
                         "query_filter_config": {"type": "std_filter", "filter_args": {"std_threshold": 0.0}}}}
    stages = start_stages(write_config(tmp_path, topics, PARTITIONS, rewards=rewards), kafka_broker,
                          tmp_path / "logs", Stage.aggregator)
    try:
        publish_rewarded(kafka_broker, topics, [response("flat", i, reward=0.0) for i in range(2)]
                         + [response("mixed", i, reward=float(i)) for i in range(2)])
        wait_for(lambda: read_values(kafka_broker, topics.groups_rejected) and read_values(
            kafka_broker, topics.generation_requests), what="screened group and a request", stages=stages)
        [flat] = read_values(kafka_broker, topics.groups_rejected)
        assert (flat["prompt_id"], flat["reason"], flat["responses_generated"], flat["rounds"]) == ("flat", "screened_out", 2, 1)
        assert flat["decision_values"]["screening_samples"] == 2.0 and flat["decision_values"]["std"] == 0.0
        [req] = read_values(kafka_broker, topics.generation_requests)
        assert (req["prompt_id"], req["round"], req["num_return_sequences"], req["sample_offset"]) == ("mixed", 1, 2, 2)
        publish_rewarded(kafka_broker, topics, [response("mixed", i, round_=1, reward=0.0, policy_version=1)
                                                for i in (2, 3)])
        wait_for(lambda: read_values(kafka_broker, topics.groups_accepted), what="the mixed group", stages=stages)
        [mixed] = read_values(kafka_broker, topics.groups_accepted)
        assert [(r["response"]["sample_index"], r["response"]["policy_version"]) for r in mixed["responses"]] == [
            (0, 0), (1, 0), (2, 1), (3, 1)]
        assert (mixed["rounds"], mixed["policy_version"], mixed["decision_values"]["screening_samples"]) == (2, 0, 2.0)
        outcomes = {o["prompt_id"]: (o["reason"], o["reward_pattern"]) for o in read_values(kafka_broker, topics.prompt_outcomes)}
        assert outcomes == {"flat": ("screened_out", "all_wrong"), "mixed": ("accepted", "mixed")}
    finally:
        stages.close()


def test_retries_exhausted_aborts_the_prompt_and_the_stage_keeps_going(kafka_broker, topic_factory, tmp_path):
    topics = topic_factory(partitions=PARTITIONS)
    config = write_config(tmp_path, topics, PARTITIONS, max_response_rounds=2)
    stages = start_stages(config, kafka_broker, tmp_path / "logs", Stage.aggregator)
    try:
        publish_rewarded(kafka_broker, topics,
                         [response("pX", i, finish_reason="error") for i in range(4)])
        wait_for(lambda: read_values(kafka_broker, topics.generation_requests), what="replacement", stages=stages)
        publish_rewarded(kafka_broker, topics,
                         [response("pX", i, round_=1, finish_reason="error") for i in range(4, 8)]
                         + [response("pY", i, reward=float(i)) for i in range(4)])
        wait_for(lambda: len(read_values(kafka_broker, topics.prompt_outcomes)) == 2, what="two outcomes", stages=stages)
        [rejected] = read_values(kafka_broker, topics.groups_rejected)
        assert (rejected["prompt_id"], rejected["reason"], rejected["rounds"]) == ("pX", "response_retries_exhausted", 2)
        assert rejected["decision_values"]["rejected_responses/engine_error"] == 8.0
        outcomes = {o["prompt_id"]: (o["outcome"], o["reason"]) for o in read_values(kafka_broker, topics.prompt_outcomes)}
        assert outcomes == {"pX": ("abort", "response_retries_exhausted"), "pY": ("commit", "accepted")}
        assert len(read_values(kafka_broker, topics.generation_requests)) == 1  # bounded: 2 rounds in total
    finally:
        stages.close()


def test_corrupt_events_are_dead_lettered_and_the_rest_still_flow(kafka_broker, aggregator):
    topics, stages = aggregator
    producer = make_producer(kafka_broker)
    producer.send(topics.responses_rewarded, key=b"pD", value=b"not avro at all")
    producer.send(topics.responses_rewarded, key=b"pD", value=b"\xc3\x01" + b"\x01" * 8 + b"\x00")
    producer.send(topics.responses_rewarded, key=b"pD", value=encode(
        {"prompt_id": "pD", "domain": "synth", "prompt": "q"}, "Prompt"))
    producer.send(topics.responses_rewarded, key=b"pD", value=encode(response("pD", 0, domain="nope"), "RewardedResponse"))
    producer.flush()
    publish_rewarded(kafka_broker, topics,
                     [response("pOK", i, reward=float(i % 2)) for i in range(4)])
    wait_for(lambda: read_values(kafka_broker, topics.groups_accepted), what="group after corrupt events", stages=stages)
    dead = read_values(kafka_broker, topics.dead_letter)
    assert [d["reason"] for d in dead] == ["undecodable", "unknown_schema", "invalid_event", "invalid_event"]
    assert dead[0]["payload"] == b"not avro at all" and dead[0]["source_topic"] == topics.responses_rewarded
    assert "unknown domain 'nope'" in dead[3]["error"]
    assert [g["prompt_id"] for g in read_values(kafka_broker, topics.groups_accepted)] == ["pOK"]


def test_two_aggregator_processes_decide_200_prompts_exactly_once(kafka_broker, topic_factory, tmp_path):
    topics = topic_factory(partitions=PARTITIONS)
    config = write_config(tmp_path, topics, PARTITIONS)
    stages = start_stages(config, kafka_broker, tmp_path / "logs", Stage.aggregator)
    assert stages.start(Stage.aggregator) == "aggregator-2"
    try:
        # Both processes hold their partitions before any event: a rebalance while events are in
        # flight may decide a prompt again (at least once; admission, the trainer and audit take
        # a repeated identical decision for one), which the fault tests cover.
        wait_for_group(kafka_broker, names.app_id(topics, names.AGGREGATOR_APP), 2, stages)
        records = []
        for p in range(200):
            mixed = p % 2 == 0
            records += [response(f"p{p:03d}", i, reward=float(mixed and i == p % 4)) for i in range(4)]
        # interleave prompts so each partition sees many open transactions at once
        records.sort(key=lambda r: (r["response"]["sample_index"], r["response"]["prompt_id"]))
        publish_rewarded(kafka_broker, topics, records)
        wait_for(lambda: len(read_values(kafka_broker, topics.prompt_outcomes)) >= 200, timeout=180, what="200 outcomes", stages=stages)
        outcomes = read_values(kafka_broker, topics.prompt_outcomes)
        assert len(outcomes) == 200
        assert len({o["prompt_id"] for o in outcomes}) == 200
        accepted = read_values(kafka_broker, topics.groups_accepted)
        rejected = read_values(kafka_broker, topics.groups_rejected)
        assert sorted(g["prompt_id"] for g in accepted) == [f"p{p:03d}" for p in range(0, 200, 2)]
        assert sorted(g["prompt_id"] for g in rejected) == [f"p{p:03d}" for p in range(1, 200, 2)]
        assert {g["reason"] for g in rejected} == {"zero_std"}
        assert all(len(g["responses"]) == 4 for g in accepted)
    finally:
        stages.close()

