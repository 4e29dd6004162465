"""The aggregator's table value: PromptState + accepted response bytes (no broker), and the
decision plane's size: no event after the Response grows with the response's length."""

from __future__ import annotations

import numpy as np
import pytest

from rollstream.config import parse_config
from rollstream.filtering.prompt_state import DomainFilters, step
from rollstream.kafka.events import Input
from rollstream.kafka.topics import Topics
from rollstream.schemas import decode, encode
from rollstream.schemas.codec import _zigzag_varint
from rollstream.schemas.records import payload_ref
from rollstream.streams.aggregator_processor import AggregatorProcessor, member_bytes, pack_state, unpack_state
from rollstream.workers.rewards import RewardWorker
from tests.integration.harness import response

GROUP = 16


def test_state_value_round_trip_keeps_response_bytes_in_order():
    f = DomainFilters(num_return_sequences=3)
    state, stored = None, {}
    for i in (2, 0):
        rec = response("pS", i, reward=1.0)
        state, _ = step(state, rec, f)
        stored[str(i)] = encode(rec, "RewardedResponse")
    back_state, back_stored = unpack_state(pack_state(state, stored))
    assert back_state == state and back_stored == stored and list(back_stored) == ["2", "0"]


def _payloads(tokens: int, prompt: str = "What is 0 + 1?") -> list[bytes]:
    """A group of encoded Response payloads, ``tokens`` response tokens each (with a 2-D extra)."""
    rng = np.random.default_rng(tokens)
    out = []
    for i in range(GROUP):
        out.append(encode({
            "prompt_id": "pBig", "domain": "synth", "mode": "train", "prompt": prompt,
            "ground_truth": "1", "round": 0, "sample_index": i,
            "prompt_token_ids": np.arange(32, dtype=np.int32),
            "response_token_ids": rng.integers(0, 150_000, tokens, dtype=np.int32),
            "infer_logprobs": -rng.random(tokens, dtype=np.float32),
            "response_text": "#### 1" if i % 2 else "#### 2", "finish_reason": "stop", "error": None,
            "policy_version": 0, "generation_ms": 5.0, "created_ms": 1_700_000_000_000,
            "extras": {"routed_experts": {"dtype": "uint8", "shape": [tokens, 2],
                                          "data": rng.integers(0, 64, tokens * 2, dtype=np.uint8).tobytes()}},
        }, "Response"))
    return out


def _decision_plane(tokens: int, prompt: str = "What is 0 + 1?") -> tuple[list[bytes], bytes, int]:
    """The real path: reward worker -> aggregator. Returns (RewardedResponse events, the Group
    event, total payload bytes)."""
    topics = Topics("size.")
    payloads = _payloads(tokens, prompt)
    inputs = []
    for offset, value in enumerate(payloads):
        schema, record = decode(value)
        inputs.append(Input(schema, record, topics.responses, 0, 1000 + offset, b"pBig", value))
    rewarded = [encode(o.record, o.schema) for o in RewardWorker(topics, {"synth": "gsm8k"})(inputs)]
    config = parse_config({
        "name": "size", "kafka": {"topic_prefix": topics.prefix, "partitions": 1}, "rollout_batch_size": 1,
        "num_return_sequences_in_group": GROUP, "max_prompts_per_batch": 4, "datasets": [],
        "rewards": {"synth": {"reward_type": "gsm8k",
                              "query_filter_config": {"type": "std_filter", "filter_args": {"std_threshold": 0.0}}}},
    })
    aggregation = AggregatorProcessor(config)
    table, group = None, None
    for value in rewarded:
        applied = aggregation.apply(table, value, decode(value)[1])
        if applied.changed:
            table = aggregation.table_value("pBig")
        for send in applied.sends:
            if send.topic == topics.groups_accepted:
                group = send.value
    assert group is not None, "the group was not accepted"
    return rewarded, group, sum(len(p) for p in payloads)


def test_decision_events_do_not_grow_with_response_length():
    small_rr, small_group, small_payload = _decision_plane(16)
    big_rr, big_group, big_payload = _decision_plane(16384)
    assert big_payload > 16 * 16384 * 9  # the payload plane holds the tokens: int32 + float32 + 2 x uint8 each
    # only varint widths differ: response_length (16 vs 16384) and the payload's size_bytes
    for small, big in zip(small_rr, big_rr):
        assert 0 <= len(big) - len(small) <= 4, (len(small), len(big))
    assert 0 <= len(big_group) - len(small_group) <= 4 * GROUP, (len(small_group), len(big_group))
    assert len(big_group) < 8 * 1024  # 16 responses of 16384 tokens: a few hundred bytes each
    _, group = decode(big_group)
    assert [r["response"]["response_length"] for r in group["responses"]] == [16384] * GROUP
    assert [r["payload"]["offset"] for r in group["responses"]] == list(range(1000, 1000 + GROUP))
    assert "prompt_token_ids" not in group


def test_group_members_do_not_repeat_the_prompt():
    short = "What is 0 + 1?"
    long = short + " Think step by step." * 200
    _, short_group, _ = _decision_plane(16, short)
    _, long_group, _ = _decision_plane(16, long)
    # the Group carries the prompt once; its members carry neither prompt nor ground truth
    assert len(long_group) - len(short_group) == len(long) - len(short) + 1  # + one varint byte
    _, group = decode(long_group)
    assert group["prompt"] == long and group["ground_truth"] == "1"
    assert {(r["response"]["prompt"], r["response"]["ground_truth"]) for r in group["responses"]} == {("", "")}


def _config(n: int = 4):
    return parse_config({
        "name": "batch", "kafka": {"topic_prefix": "b.", "partitions": 1}, "rollout_batch_size": 1,
        "num_return_sequences_in_group": n, "max_prompts_per_batch": 4, "datasets": [],
        "rewards": {"synth": {"reward_type": "gsm8k",
                              "query_filter_config": {"type": "std_filter", "filter_args": {"std_threshold": 0.0}}}},
    })


def _run(events: list[bytes], batch: int, aggregation: AggregatorProcessor | None = None,
         table: dict | None = None) -> tuple[list[dict], dict, AggregatorProcessor]:
    """Apply ``events`` in batches, writing each changed prompt's value once per batch."""
    aggregation = aggregation or AggregatorProcessor(_config())
    table = {} if table is None else table
    decided = []
    for start in range(0, len(events), batch):
        changed = set()
        for value in events[start:start + batch]:
            record = decode(value)[1]
            pid = record["response"]["prompt_id"]
            applied = aggregation.apply(table.get(pid), value, record)
            if applied.changed:
                changed.add(pid)
            decided += [{k: v for k, v in decode(s.value)[1].items() if k != "created_ms"}
                        for s in applied.sends if s.topic in (aggregation.topics.groups_accepted,
                                                               aggregation.topics.groups_rejected)]
        for pid in changed:
            table[pid] = aggregation.table_value(pid)
    return decided, table, aggregation


def test_batched_table_writes_decide_exactly_like_one_write_per_event():
    rewards = {"pA": [1.0, 0.0, 0.0, 0.0], "pB": [0.0] * 4, "pC": [1.0, 1.0, 0.0, 1.0]}
    events = [encode(response(pid, i, reward=r[i], payload=payload_ref("b.responses", 0, 10 * k + i, 99)),
                     "RewardedResponse") for i in range(4) for k, (pid, r) in enumerate(rewards.items())]
    events.insert(7, events[1])  # a redelivery inside the batch
    one, table_one, agg_one = _run(events, batch=1)
    batched, table_batched, agg_batched = _run(events, batch=100)
    assert [(g["prompt_id"], g["reason"]) for g in one] == [("pA", "accepted"), ("pB", "zero_std"), ("pC", "accepted")]
    assert batched == one
    assert {k: unpack_state(v)[0] for k, v in table_batched.items()} == {k: unpack_state(v)[0] for k, v in table_one.items()}
    # the held state was used throughout: no table value decoded again, nothing held once decided
    assert agg_one.state_decodes == agg_batched.state_decodes == 0
    assert agg_batched._held == {}


def test_a_restarted_aggregation_decodes_the_table_and_continues():
    events = [encode(response("pR", i, reward=float(i == 0)), "RewardedResponse") for i in range(4)]
    _, table, first = _run(events[:3], batch=2)
    decided, _, restarted = _run(events[2:], batch=2, aggregation=AggregatorProcessor(_config()), table=table)
    assert restarted.state_decodes == 1  # the table value was not one it had packed: decoded once
    assert [(g["prompt_id"], g["accepted"], [r["response"]["sample_index"] for r in g["responses"]])
            for g in decided] == [("pR", True, [0, 1, 2, 3])]  # the redelivered index 2 counted once


def test_a_failure_after_unwritten_changes_is_reported_never_silently_dropped(monkeypatch):
    from rollstream.streams import aggregator_processor as module

    events = [encode(response("pF", i, reward=float(i == 0)), "RewardedResponse") for i in range(4)]
    aggregation = AggregatorProcessor(_config())
    assert aggregation.apply(None, events[0], decode(events[0])[1]).changed
    assert aggregation.unwritten("pF")

    def boom(*args, **kwargs):
        raise RuntimeError("filter bug")

    monkeypatch.setattr(module, "step", boom)
    with pytest.raises(module.UnwrittenStateLost, match="pF.*filter bug"):
        aggregation.apply(None, events[1], decode(events[1])[1])
    assert not aggregation.unwritten("pF")
    # with the changes written, the same failure only fails that event: the table value is intact
    monkeypatch.undo()
    aggregation.apply(None, events[0], decode(events[0])[1])
    table = aggregation.table_value("pF")
    monkeypatch.setattr(module, "step", boom)
    with pytest.raises(RuntimeError, match="filter bug"):
        aggregation.apply(table, events[1], decode(events[1])[1])
    monkeypatch.undo()
    assert aggregation.apply(table, events[1], decode(events[1])[1]).changed
    assert aggregation.state_decodes == 1


CHAT = [{"role": "system", "content": "Answer briefly. " * 20}, {"role": "user", "content": "é?"}]


@pytest.mark.parametrize("prompt, truth, messages", [
    ("q", "1", []), ("é" * 70, "", []), ("", "x" * 300, []), ("p" * 20000, "42" * 99, []),
    ("é?", "1", CHAT), ("", "", CHAT), ("", "", [{"role": "user", "content": "m" * 200}] * 70),
])
def test_member_bytes_cut_at_the_byte_level_equal_a_re_encode(prompt, truth, messages):
    record = response("p-é", 3, reward=1.0, payload=payload_ref("t", 0, 7, 9))
    record["response"].update(prompt=prompt, ground_truth=truth, messages=messages, domain="d" * 130, mode="train")
    value = encode(record, "RewardedResponse")
    cut = member_bytes(record, value)
    expected = encode({**record, "response": {**record["response"], "prompt": "", "ground_truth": "", "messages": []}},
                      "RewardedResponse")
    assert cut == expected
    assert decode(cut)[1]["response"]["messages"] == []


def test_member_bytes_reads_messages_written_in_sized_blocks():
    """Avro lets a writer give an array block a negative count followed by its byte size (Java's
    blocking encoder does): the cut skips such a block too."""
    record = response("pB", 1, reward=1.0, payload=payload_ref("t", 0, 7, 9))
    record["response"].update(prompt="é?", ground_truth="1", messages=CHAT)
    value = encode(record, "RewardedResponse")
    items = b"".join(_zigzag_varint(len(s.encode())) + s.encode() for m in CHAT for s in (m["role"], m["content"]))
    standard = _zigzag_varint(len(CHAT)) + items + b"\x00"
    sized = value.replace(standard, _zigzag_varint(-len(CHAT)) + _zigzag_varint(len(items)) + items + b"\x00")
    assert value.count(standard) == 1 and sized != value
    assert decode(sized)[1] == decode(value)[1]
    assert member_bytes(record, sized) == member_bytes(record, value)
