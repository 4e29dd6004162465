"""The aggregator's deadlines without faust: requests recorded, the due index, reissues to another
partition, the prompt_timeout decision, and the index rebuilt from table values."""

from __future__ import annotations

from rollstream.config import parse_config
from rollstream.schemas import decode, encode
from rollstream.streams.aggregator_processor import AggregatorProcessor, prompt_partition
from rollstream.streams.event_builders import derive_seed, generation_request
from tests.integration.harness import response

PARTITIONS = 4


def deadline_config():
    """Four partitions, groups of 2 responses (std filter), a 5 s deadline, one reissue."""
    return parse_config({
        "name": "dl", "kafka": {"topic_prefix": "dl.", "partitions": PARTITIONS}, "rollout_batch_size": 1,
        "num_return_sequences_in_group": 2, "max_prompts_per_batch": 4, "datasets": [],
        "prompt_timeout_s": 5, "max_reissues_per_prompt": 1,
        "rewards": {"synth": {"reward_type": "gsm8k",
                              "query_filter_config": {"type": "std_filter", "filter_args": {"std_threshold": 0.0}}}},
    })


def _aggregation() -> AggregatorProcessor:
    return AggregatorProcessor(deadline_config())


def request_of(pid: str) -> dict:
    prompt = {"prompt_id": pid, "domain": "synth", "mode": "train", "prompt": f"question {pid}", "ground_truth": "1",
              "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"question {pid}"}]}
    return generation_request(prompt, round_=0, num_return_sequences=2, sample_offset=0, seed=derive_seed(0, pid, 0))


def test_a_silent_prompt_is_reissued_to_the_next_partition_then_aborted_prompt_timeout():
    agg, table = _aggregation(), {}
    request = request_of("pA")
    applied = agg.request(None, request, now=1_000)
    assert applied.changed and agg.deadlines == {"pA": 6_000}
    table["pA"] = agg.table_value("pA")
    rec = response("pA", 0, reward=1.0)
    agg.apply(table["pA"], encode(rec, "RewardedResponse"), rec, now=2_000)
    table["pA"] = agg.table_value("pA")
    assert agg.due(now=5_999) == [] and agg.due(now=6_000) == ["pA"]

    applied = agg.expire("pA", table["pA"], now=6_000)
    [send] = applied.sends
    home = prompt_partition("pA", PARTITIONS)
    assert (send.topic, send.key, send.partition) == ("dl.generation.requests", "pA", (home + 1) % PARTITIONS)
    _, reissued = decode(send.value)
    assert {k: v for k, v in reissued.items() if k != "created_ms"} == {
        k: v for k, v in request.items() if k != "created_ms"}  # the same round, seed and sample indices
    table["pA"] = agg.table_value("pA")
    assert agg.deadlines == {"pA": 11_000}

    applied = agg.expire("pA", table["pA"], now=11_000)
    assert applied.decided.reason == "prompt_timeout"
    group_send, outcome_send = applied.sends
    assert group_send.topic == "dl.groups.rejected"
    _, group = decode(group_send.value)
    assert (group["reason"], group["prompt"], group["messages"][0]["content"], len(group["responses"])) == (
        "prompt_timeout", "question pA", "Be brief.", 1)
    assert group["decision_values"] == {"reissues": 1.0, "missing": 1.0, "accepted": 1.0, "rounds": 1.0}
    _, outcome = decode(outcome_send.value)
    assert (outcome["prompt_id"], outcome["outcome"], outcome["reason"]) == ("pA", "abort", "prompt_timeout")
    table["pA"] = agg.table_value("pA")
    assert agg.deadlines == {} and agg.expire("pA", table["pA"], now=99_000).sends == []


def test_the_deadline_index_is_rebuilt_from_table_values_after_a_restart():
    agg, table = _aggregation(), {}
    for pid, now in (("pA", 0), ("pB", 100)):
        agg.request(None, request_of(pid), now=now)
        table[pid] = agg.table_value(pid)
    for i in (0, 1):  # pB completes: decided, no deadline any more
        rec = response("pB", i, reward=float(i))
        agg.apply(table["pB"], encode(rec, "RewardedResponse"), rec)
        table["pB"] = agg.table_value("pB")
    restarted = _aggregation()
    assert restarted.index((k.encode(), v) for k, v in table.items()) == 1
    assert restarted.deadlines == {"pA": 5_000}
    assert [s.topic for s in restarted.expire("pA", table["pA"], now=5_000).sends] == ["dl.generation.requests"]
