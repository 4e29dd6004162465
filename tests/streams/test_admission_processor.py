"""The admission processor without faust or Kafka: a MemoryStore, the bundled model's tokenizer,
and the events it returns."""

from __future__ import annotations

import json

from rollstream.config import parse_config
from rollstream.filtering import admission as core
from rollstream.filtering.history import PromptHistory
from rollstream.kafka import names
from rollstream.kafka.events import Output
from rollstream.kafka.topics import Topics
from rollstream.schemas import decode
from rollstream.streams.admission_processor import AdmissionProcessor, Screened, default_tokenize
from rollstream.streams.event_builders import derive_seed
from rollstream.streams.processor import Handled
from rollstream.streams.store import MemoryStore

TOPICS = Topics("t.")
BASE = {"rollout_batch_size": 2, "num_return_sequences_in_group": 4, "max_running_prompts": 2,
        "max_prompts_per_batch": 3, "rewards": {"math": {"reward_type": "gsm8k"}}, "datasets": [], "seed": 7,
        "max_steps": 10}
TOKENIZE = default_tokenize(None)


def processor(table: MemoryStore | None = None, version: int | None = None, **overrides) -> AdmissionProcessor:
    return AdmissionProcessor(parse_config({**BASE, **overrides}), TOPICS, MemoryStore() if table is None else table,
                              TOKENIZE, lambda max_age_s=0.0: version)


def prompt(prompt_id: str, mode: str = "train", text: str = "What is 2+3?") -> dict:
    return {"prompt_id": prompt_id, "domain": "math", "prompt": text, "mode": mode, "ground_truth": "5"}


def sent(handled: Handled) -> list[Output]:
    """The events ``handled`` sends, decoded (every one decodes as its schema)."""
    assert handled.error is None
    return [Output(s.topic, s.key, *decode(s.value)) for s in handled.sends]


def admit(p: AdmissionProcessor, record: dict, **kwargs) -> list[Output]:
    assert p.can_admit(record.get("mode", "train"))
    return sent(p.admit(record, p.tokenize(record), **kwargs))


def outcome(prompt_id: str, commit: bool, pattern: str = "") -> dict:
    return {"prompt_id": prompt_id, "outcome": "commit" if commit else "abort",
            "reason": "accepted" if commit else "std_zero", "mode": "train", "reward_pattern": pattern,
            "policy_version": 0}


def test_an_admitted_prompt_becomes_one_generation_request_and_takes_a_credit():
    p = processor()
    [out] = admit(p, prompt("a"), offset=5)
    assert (out.topic, out.key, out.schema) == (TOPICS.generation_requests, "a", "GenerationRequest")
    assert (out.record["num_return_sequences"], out.record["seed"], out.record["round"]) == (4, derive_seed(7, "a", 0), 0)
    assert p.load().in_flight == {"a": 0} and p.store[names.ADMISSION_SEEN_PREFIX + b"a"] == b"5"
    admit(p, prompt("b"))
    assert not p.can_admit("train")  # max_running_prompts 2
    assert sent(p.on_outcome(outcome("a", True))) == [] and not p.can_admit("train")  # accepted + in flight cover the batch
    sent(p.on_outcome(outcome("b", False)))
    assert p.can_admit("train")  # a rejection frees exactly one slot


def test_a_screened_domain_asks_for_its_first_k_samples_and_validation_for_its_own_count():
    p = processor(rewards={"math": {"reward_type": "gsm8k", "screening": {"samples": 2},
                                    "query_filter_config": {"type": "std_filter", "filter_args": {"std_threshold": 0}}}},
                  val_num_return_sequences=3)
    [train] = admit(p, prompt("a"))
    [val] = admit(p, prompt("val/b", mode="val"))
    assert (train.record["num_return_sequences"], train.record["sample_offset"]) == (2, 0)
    assert val.record["num_return_sequences"] == 3


def test_screening_tells_redeliveries_duplicates_and_unknown_domains_apart():
    p = processor()
    admit(p, prompt("a"), offset=3)
    assert p.screen("Prompt", prompt("a"), 3) == Screened("skip", "prompt a at offset 3: already admitted")
    assert p.screen("Prompt", prompt("a"), 4).action == "dead_letter"
    assert "duplicate prompt_id 'a'" in p.screen("Prompt", prompt("a"), 4).why
    assert p.screen("Prompt", {**prompt("c"), "domain": "chess"}, 6) == Screened("dead_letter", "unknown domain 'chess'")
    assert p.screen("Prompt", prompt("d"), 7) == Screened("admit")
    assert p.screen("PromptsEnd", {}, 8) == Screened("end")
    assert p.is_new_end(8)
    p.end_data(8, 1)
    assert p.screen("Prompt", prompt("b"), 2).action == "skip"  # before the marker: admitted already
    assert p.screen("Prompt", prompt("e"), 9) == Screened("dead_letter", "prompt after the end of data (PromptsEnd at offset 8)")
    assert not p.is_new_end(12) and p.is_new_end(8)  # a later marker is ignored, a redelivered one is not


def test_a_prompt_too_long_is_rejected_before_generation_with_its_group():
    p = processor(prompt_length=8)
    [group] = admit(p, prompt("long", text="one two three four five six seven eight nine ten"))
    assert (group.topic, group.key, group.schema) == (TOPICS.groups_rejected, "long", "Group")
    assert (group.record["reason"], group.record["accepted"], group.record["responses"]) == ("prompt_too_long", False, [])
    assert group.record["filter_config_hash"] == p.prompt_filter[1]
    state = p.load()
    assert (state.in_flight, state.rejected_in_step) == ({}, {"prompt_too_long": 1})


def test_a_spent_budget_ends_the_step_underfilled_with_a_batch_event():
    p = processor()
    for pid in ("a", "b"):
        admit(p, prompt(pid))
    sent(p.on_outcome(outcome("a", True)))
    assert sent(p.on_outcome(outcome("b", False))) == []
    admit(p, prompt("c"))  # the third and last prompt of the budget
    assert not p.can_admit("train")
    [batch] = sent(p.on_outcome(outcome("c", False)))
    assert (batch.topic, batch.key, batch.schema) == (TOPICS.batches, "0", "Batch")
    assert {k: batch.record[k] for k in ("step", "status", "target_groups", "accepted_groups", "prompts_consumed")} == {
        "step": 0, "status": "underfilled", "target_groups": 2, "accepted_groups": 1, "prompts_consumed": 3}
    assert p.load().step == 1


def test_later_epochs_replay_the_train_prompts_and_survive_a_restart():
    table = MemoryStore()
    p = processor(table, num_epochs=2, rollout_batch_size=1, max_prompts_per_batch=4)
    train = [prompt("a"), prompt("b")]
    for offset, record in enumerate(train):
        admit(p, record, offset=offset)
        sent(p.on_outcome(outcome(record["prompt_id"], True)))
    assert p.is_new_end(2) and sent(p.end_data(2, len(train))) == []
    replay = p.next_replay(train)
    first = replay.prompt["prompt_id"]
    assert first in ("a#e1", "b#e1") and replay.history_of is None
    admit(p, replay.prompt, take=replay.take)
    sent(p.on_outcome(outcome(first, True)))
    restarted = processor(table, num_epochs=2, rollout_batch_size=1, max_prompts_per_batch=4)
    second = restarted.next_replay(train)
    assert {first, second.prompt["prompt_id"]} == {"a#e1", "b#e1"}  # resumed past the first
    admit(restarted, second.prompt, take=second.take)
    assert restarted.next_replay(train) is None and not restarted.replays_left()
    [end] = sent(restarted.on_outcome(outcome(second.prompt["prompt_id"], False)))
    assert (end.record["status"], end.record["accepted_groups"], end.record["step"]) == ("end_of_data", 0, 3)


def test_a_validation_round_starts_per_new_version_and_ends_short_when_prompts_are_gone():
    p = processor(version=2, eval_steps=2)
    val = [prompt("v1", "val"), prompt("v2", "val")]
    assert p.eval_version_due() == 2 and not p.eval_running()
    p.start_eval(2, val)
    first = p.next_eval(val)
    assert first["prompt_id"] == "v1#v2"
    [request] = sent(p.admit(first, p.tokenize(first),
                                take=lambda s: (setattr(s, "eval_position", s.eval_position + 1), s)[1]))
    assert request.record["num_return_sequences"] == 1  # val_num_return_sequences
    assert p.next_eval(val[:1]) is None  # one prompt left on the topic: the round ends at 1
    assert (p.load().eval_size, p.load().eval_position) == (1, 1) and p.eval_version_due() is None


def test_outcomes_teach_the_prompt_history_once_it_is_loaded():
    p = processor(history_filter={"enable": True}, num_epochs=2)
    assert p.needs_history
    p.load_history({"a": PromptHistory("a")})
    assert not p.needs_history
    admit(p, prompt("a"))
    [entry] = sent(p.on_outcome(outcome("a", True, pattern="mixed")))
    assert (entry.topic, entry.key, entry.schema) == (TOPICS.prompt_history, "a", "PromptHistory")
    assert p.histories["a"].to_record() == entry.record
    assert json.loads(p.store[names.ADMISSION_KEY])["explore"] is not None
    assert sent(p.on_outcome(outcome("a", True, pattern="mixed"))) == []  # a redelivery learns nothing


def test_revisits_paced_by_versions_read_the_published_version():
    """history_filter.revisit_versions: a prompt found all-wrong at version 0 is skipped while the
    newest version is still 0 (its rejected group says E = 0), and admitted whatever the draw
    once max_skips * revisit_versions versions have passed."""
    history = {"enable": True, "revisit_versions": 4, "max_skips": 3}
    train = [prompt("a"), prompt("b")]
    found = {"a": PromptHistory("a", [{"epoch": 0, "pattern": "all_wrong", "policy_version": 0}])}
    for version, skipped in ((0, True), (12, False)):
        p = processor(version=version, history_filter=history, num_epochs=3, rollout_batch_size=1)
        p.load_history(dict(found))
        for offset, record in enumerate(train):
            admit(p, record, offset=offset)
            sent(p.on_outcome(outcome(record["prompt_id"], False, pattern="all_wrong")))
        p.end_data(2, len(train))
        while (replay := p.next_replay(train)).prompt["prompt_id"] != "a#e1":
            admit(p, replay.prompt, take=replay.take, history_of=replay.history_of)
        out = sent(p.admit(replay.prompt, p.tokenize(replay.prompt), take=replay.take, history_of=replay.history_of))
        groups = [o.record for o in out if o.schema == "Group"]
        assert [g["reason"] for g in groups] == (["skipped_by_history"] if skipped else [])
        if skipped:
            assert groups[0]["decision_values"]["versions_elapsed"] == 0.0 and groups[0]["policy_version"] == 0
        else:
            assert [o.schema for o in out] == ["GenerationRequest"]


def test_a_pass_that_skipped_every_prompt_at_one_version_is_not_repeated():
    """Paced by versions, a pass at an unchanged version would decide as the last did: once an
    epoch's worth was skipped, admission takes the next prompt in order, one at a time (it waits
    while one is in flight: history_stalled), until a new version. No epoch is raced through."""
    version = [0]
    p = AdmissionProcessor(parse_config({**BASE, "history_filter": {"enable": True, "revisit_versions": 16},
                                         "num_epochs": 6}), TOPICS, MemoryStore(), TOKENIZE,
                           lambda max_age_s=0.0: version[0])
    p.load_history({})
    train = [prompt("a"), prompt("b")]
    for offset, record in enumerate(train):
        admit(p, record, offset=offset)
        sent(p.on_outcome(outcome(record["prompt_id"], False, pattern="all_wrong")))
    p.end_data(2, len(train))

    def next_schemas() -> tuple[str, list[str]]:
        replay = p.next_replay(train)
        out = sent(p.admit(replay.prompt, p.tokenize(replay.prompt), take=replay.take, history_of=replay.history_of))
        return replay.prompt["prompt_id"], [o.schema for o in out if o.schema != "PromptHistory"]

    assert [next_schemas()[1] for _ in range(2)] == [["Group"]] * 2  # epoch 1: both skipped (E = 0)
    assert not p.history_stalled()  # nothing in flight: the next prompt is admitted
    first, schemas = next_schemas()
    assert first.endswith("#e2") and schemas == ["GenerationRequest"]
    assert p.history_stalled()  # in flight: the next one waits for its outcome ...
    sent(p.on_outcome(outcome(first, False, pattern="all_wrong")))
    second, schemas = next_schemas()  # ... then comes next, with no pass of skips between
    assert second.endswith("#e2") and second != first and schemas == ["GenerationRequest"]
    version[0] = 1
    assert not p.history_stalled() and not core.history_pass_done(p.load(), 1)  # a new version: judged again
