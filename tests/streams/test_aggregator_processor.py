"""The aggregator's processor shape (rollstream.streams.processor) without faust, over a store:
bad input comes back as dead-letter reasons, a batch writes each changed prompt once and only when
it ends, a failure after held changes is a StageFault that writes nothing of that prompt, a tick
reissues and aborts the late prompts of the owned partitions (rebuilding its deadline index from
the store first), and decided prompts leave the table after their time to live."""

from __future__ import annotations

import pytest

from rollstream.exceptions import StageFault
from rollstream.schemas import decode, encode
from rollstream.streams import aggregator_processor as ap
from rollstream.streams.aggregator_processor import DECIDED_TTL_S, AggregatorProcessor, prompt_partition
from rollstream.streams.store import MemoryStore
from tests.integration.harness import response
from tests.streams.test_aggregator_deadlines import PARTITIONS, deadline_config, request_of


class LoggedStore(MemoryStore):
    """A MemoryStore that logs its writes: (partition, key, deleted)."""

    def __init__(self) -> None:
        super().__init__()
        self.puts: list[tuple[int, bytes, bool]] = []

    def put(self, partition: int, key: bytes, value: bytes | None) -> None:
        self.puts.append((partition, key, value is None))
        super().put(partition, key, value)


def _setup(store: LoggedStore | None = None) -> tuple[AggregatorProcessor, LoggedStore]:
    store = LoggedStore() if store is None else store
    return AggregatorProcessor(deadline_config(), store), store


def _handle(processor: AggregatorProcessor, pid: str, index: int, reward: float, domain: str = "synth"):
    value = encode(response(pid, index, reward=reward, domain=domain), "RewardedResponse")
    return processor.handle(processor.topics.responses_rewarded, prompt_partition(pid, PARTITIONS), value, offset=index)


def test_bad_input_comes_back_as_a_dead_letter_reason_and_writes_nothing():
    processor, store = _setup()
    rewarded = processor.topics.responses_rewarded
    assert processor.handle(rewarded, 0, b"\x00garbage", offset=0).error[0] == "undecodable"
    assert processor.handle("elsewhere", 0, b"", offset=1).error == (
        "invalid_event", "elsewhere is not an input of the aggregator")
    assert _handle(processor, "pA", 0, 1.0, domain="other").error == (
        "invalid_event", "unknown domain 'other'; configured: ['synth']")
    request = encode(request_of("pA"), "GenerationRequest")
    assert processor.handle(rewarded, 0, request, offset=2).error[0] == "invalid_event"  # a request, on the wrong topic
    processor.end_batch()
    assert store == {} and store.puts == []


def test_a_batch_writes_each_changed_prompt_once_when_it_ends():
    processor, store = _setup()
    home = prompt_partition("pA", PARTITIONS)
    assert _handle(processor, "pA", 0, 0.0).sends == [] and store == {}
    group, outcome = _handle(processor, "pA", 1, 1.0).sends  # std > 0: accepted
    assert (group.topic, outcome.topic) == ("dl.groups.accepted", "dl.prompt.outcomes")
    _, record = decode(group.value)
    assert [r["response"]["sample_index"] for r in record["responses"]] == [0, 1]
    assert store == {}  # nothing written before the batch ends
    processor.end_batch()
    assert store.puts == [(home, b"pA", False)]
    state, responses = ap.unpack_state(store[b"pA"])
    assert (state.decided, responses) == ("accepted", {})  # decided: only what answers redeliveries is kept
    assert _handle(processor, "pA", 1, 1.0).log == ["redelivered response of pA ignored"]
    processor.end_batch()
    assert store.puts == [(home, b"pA", False)]  # a redelivery changes nothing


def test_a_failure_after_held_changes_is_a_stage_fault_and_that_prompt_is_not_written(monkeypatch):
    processor, store = _setup()
    _handle(processor, "pB", 0, 0.0)
    processor.end_batch()
    written = store[b"pB"]
    _handle(processor, "pB", 1, 1.0)  # held, not written: the batch has not ended

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(ap, "step", broken)
    with pytest.raises(StageFault, match="prompt pB"):
        _handle(processor, "pB", 2, 1.0)
    processor.end_batch()
    assert store[b"pB"] is written  # the restarted stage reprocesses from here


def test_a_tick_reissues_then_aborts_the_late_prompts_of_the_owned_partitions_only():
    processor, store = _setup()
    home = prompt_partition("pA", PARTITIONS)
    processor.handle(processor.topics.generation_requests, home, encode(request_of("pA"), "GenerationRequest"),
                     now=1_000, offset=0)
    processor.end_batch()
    assert store.puts == [(home, b"pA", False)]
    assert processor.tick({home}, now=5_999).sends == []

    restarted, _ = _setup(store)  # a new process over the restored table: its index is rebuilt
    handled = restarted.tick({home}, now=6_000)
    assert handled.log == [f"deadline index rebuilt: 1 prompts waiting in partitions [{home}]"]
    [reissue] = handled.sends
    assert (reissue.topic, reissue.partition) == ("dl.generation.requests", (home + 1) % PARTITIONS)
    restarted.end_batch()
    assert store.puts[-1] == (home, b"pA", False)
    decided = restarted.tick({home}, now=11_000).sends
    assert [s.topic for s in decided] == ["dl.groups.rejected", "dl.prompt.outcomes"]

    elsewhere, _ = _setup(store)
    elsewhere.tick({(home + 1) % PARTITIONS}, now=99_000)  # pA's partition is not this worker's
    assert elsewhere.deadlines == {}


def test_decided_prompts_leave_the_table_after_their_time_to_live_in_owned_partitions(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(ap.time, "monotonic", lambda: clock[0])
    processor, store = _setup()
    home = prompt_partition("pA", PARTITIONS)
    _handle(processor, "pA", 0, 0.0)
    _handle(processor, "pA", 1, 1.0)
    processor.end_batch()
    clock[0] += DECIDED_TTL_S + 1
    processor.tick(set(), now=0)
    processor.end_batch()
    assert b"pA" in store  # its partition was in neither this batch nor this tick
    processor.tick({home}, now=0)
    processor.end_batch()
    assert b"pA" not in store and store.puts[-1] == (home, b"pA", True)
