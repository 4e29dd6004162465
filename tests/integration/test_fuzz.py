"""Bad input, generated (tests/fuzz_events.py), into every input topic of every RLVR stage while
the pipeline runs on good prompts: every malformed event lands in ``dead-letter`` with a reason,
every good prompt is decided as it would be alone, and no stage dies (the supervisor is told to
restart nothing).

RLVR stages: admission (prompts, prompt.outcomes), generation (generation.requests; a tiny
random model, tests/tiny_models.py), reward (responses), aggregator (responses.rewarded; it also
reads generation.requests, where it skips what the generation worker dead-letters), trainer
(groups.accepted; `rollstream worker trainer` without a model). Agentic: group queue
(trajectories, episodes.control), env worker (episodes.requests), trainer. 1,310 malformed events
in all; the test prints the counts per topic.
"""

from __future__ import annotations

import json
import time
from collections import Counter

import pytest

from rollstream.app.processes import StageProcesses
from rollstream.app.producer import start_env_groups
from rollstream.app.stages import Stage
from rollstream.config import load_config
from rollstream.kafka.admin import create_pipeline_topics
from rollstream.kafka.clients import make_producer
from rollstream.schemas import encode
from rollstream.streams.event_builders import derive_seed, generation_request, group_record, prompt_outcome
from rollstream.tools.audit import run_audit
from rollstream.tools.readback import read_values
from tests.fuzz_events import interleave, malformed
from tests.tiny_models import build_tiny_qwen2

from .harness import (DOMAIN, prompt, response, response_payload, synthetic_trajectory, wait_for, write_agentic_config,
                      write_config)
from .test_end_of_data import end_data, verdicts

pytestmark = pytest.mark.integration

GOOD_PROMPTS = 8
DEAD_LETTER_REASONS = {"undecodable", "unknown_schema", "invalid_event"}


def _records():
    """One valid record of each input schema (the seeds of the malformed ones)."""
    p = {**prompt("p0"), "messages": [], "tag": "", "created_ms": 0}
    rewarded = response("p0", 0, reward=1.0)
    return {
        "Prompt": p,
        "PromptOutcome": prompt_outcome(p, committed=True, reason="accepted", rounds=1, responses_generated=2),
        "GenerationRequest": generation_request(p, round_=0, num_return_sequences=2, sample_offset=0,
                                                seed=derive_seed(0, "p0", 0)),
        "Response": response_payload("p0", 0),
        "RewardedResponse": rewarded,
        "Group": group_record(prompt=p, decided_accepted=True, reason="accepted", values={}, responses=[rewarded],
                              filter_config="{}", filter_config_hash="0" * 16, policy_version=0, rounds=1,
                              responses_generated=1),
    }


# input topic -> (schema, schemas its consumer accepts, malformed events, checked domain)
INPUTS = {
    "prompts": ("Prompt", ("Prompt", "PromptsEnd"), 200, True),
    "prompt.outcomes": ("PromptOutcome", ("PromptOutcome",), 150, False),
    "generation.requests": ("GenerationRequest", ("GenerationRequest",), 150, True),
    "responses": ("Response", ("Response",), 150, True),
    "responses.rewarded": ("RewardedResponse", ("RewardedResponse",), 150, True),
    "groups.accepted": ("Group", ("Group", "TrajectoryGroup"), 150, False),
}


def test_malformed_events_on_every_rlvr_input_are_dead_lettered_and_the_good_ones_decided(
        kafka_broker, topic_factory, tmp_path):
    topics = topic_factory(partitions=2)
    model = build_tiny_qwen2(tmp_path / "tiny")
    config_path = write_config(
        tmp_path, topics, 2, rollout_batch_size=4, num_return_sequences_in_group=2, max_running_prompts=4,
        max_steps=GOOD_PROMPTS // 4 + 1, pretrain=str(model), actor_train={"enabled": False},
        actor_infer={"max_batch": 8, "generating_args": {"max_new_tokens": 4}},
        rewards={DOMAIN: {"reward_type": "gsm8k", "query_filter_config": {"type": "no_filter"},
                          "response_filter_config": {"type": "default", "filter_args": {
                              "reject_truncated": False, "reject_empty": False}}}})
    config = load_config(config_path)
    create_pipeline_topics(kafka_broker, config.kafka)
    records = _records()
    bad = {}
    for n, (logical, (schema, accepts, count, domains)) in enumerate(INPUTS.items()):
        others = {k: v for k, v in records.items() if k not in accepts}
        bad[logical] = malformed(schema, records[schema], others, count, seed=n, expected=accepts,
                                 domains={DOMAIN} if domains else None)
    # the prompts topic: good prompts and malformed ones interleaved, then the end marker; the
    # other topics: half their malformed events before the stages start, half while they run
    good = [("good", {**prompt(f"g{i}"), "messages": [], "tag": "", "created_ms": 0}) for i in range(GOOD_PROMPTS)]
    producer = make_producer(kafka_broker)
    for kind, item in interleave(good, bad["prompts"], seed=7):
        value = encode(item, "Prompt") if kind == "good" else item
        producer.send(topics.prompts, key=b"fuzz", value=value)

    def inject(half: int) -> None:
        for logical, events in bad.items():
            if logical != "prompts":
                chunk = events[: len(events) // 2] if half == 0 else events[len(events) // 2:]
                for _, value in chunk:
                    producer.send(topics.name(logical), key=b"fuzz", value=value)
        producer.flush()

    inject(0)
    stages = StageProcesses(config_path, kafka_broker, tmp_path / "logs", cwd=tmp_path)  # no restarts: none may die
    (tmp_path / "logs").mkdir()
    try:
        for stage in (Stage.admission, Stage.aggregator, Stage.generation, Stage.reward, Stage.trainer):
            stages.start(stage)
        end_data(kafka_broker, topics, GOOD_PROMPTS)

        def dead_letters(at_least: int) -> bool:
            stages.check(finished=frozenset({"trainer"}))  # none may die; the trainer may end
            return len(read_values(kafka_broker, topics.dead_letter)) >= at_least

        # the second half goes in once the stages have dead-lettered the first: while they run
        first_half = sum(len(v) if k == "prompts" else len(v) // 2 for k, v in bad.items())
        wait_for(lambda: dead_letters(first_half), timeout=300, what="the first half's dead letters")
        inject(1)
        await_trainer(stages, tmp_path)
        wait_for(lambda: dead_letters(sum(len(v) for v in bad.values())), timeout=120,
                 what="every malformed event's dead letter")  # the trainer may end before the last is read
        dead = read_values(kafka_broker, topics.dead_letter)
        stages.check(finished=frozenset({"trainer"}))  # every other stage still alive after all of it
    finally:
        producer.close()
        stages.close()

    by_topic = Counter(d["source_topic"].removeprefix(topics.prefix) for d in dead)
    print(json.dumps({"malformed_per_topic": {k: len(v) for k, v in bad.items()}, "dead_letters_per_topic": by_topic,
                      "kinds": {k: Counter(kind for kind, _ in v) for k, v in bad.items()}}, sort_keys=True))
    assert by_topic == {logical: len(events) for logical, events in bad.items()}
    assert {d["reason"] for d in dead} <= DEAD_LETTER_REASONS
    assert all(d["error"] for d in dead)
    # the aggregator's groups (the malformed Groups injected on the topic are of prompt p0)
    accepted = sorted(g["prompt_id"] for g in read_values(kafka_broker, topics.groups_accepted)
                      if "group_key" in g and g["prompt_id"] != "p0")
    assert accepted == [f"g{i}" for i in range(GOOD_PROMPTS)]
    [verdict] = verdicts(kafka_broker, topics)
    assert (verdict["status"], verdict["accepted_groups"]) == ("end_of_data", 0)
    report = run_audit(kafka_broker, topics, False, tmp_path / "runs" / "it" / "batches.jsonl")
    assert report.ok, report.to_json()  # the malformed events were dead-lettered: they took no effect
    assert (report.counts["prompts_admitted"], report.counts["groups_trained"]) == (GOOD_PROMPTS, GOOD_PROMPTS)


def _episode_request() -> dict:
    return {"mode": "train", "group_id": 0, "episode_id": 0, "traj_index": 0, "tag": "lake", "env_type": "frozen_lake",
            "env_config": "{}", "seed": 1, "max_actions_per_traj": 1, "max_tokens_per_step": 4,
            "env_step_timeout_s": 30.0, "format_penalty": 0.0, "cause": "start", "created_ms": 0}


AGENTIC_INPUTS = {  # input topic -> (schema, schemas its consumer accepts, malformed events)
    "trajectories": ("Trajectory", ("Trajectory", "GroupCommand"), 120),
    "episodes.control": ("GroupCommand", ("Trajectory", "GroupCommand"), 120),
    "episodes.requests": ("EpisodeRequest", ("EpisodeRequest",), 120),
}


def test_malformed_events_on_every_agentic_input_are_dead_lettered_and_the_episodes_decided(
        kafka_broker, topic_factory, tmp_path):

    topics = topic_factory(partitions=2)
    model = build_tiny_qwen2(tmp_path / "tiny")
    config_path = write_agentic_config(
        tmp_path, topics, 2, rollout_batch_size=4, max_steps=1, pretrain=str(model), actor_train={"enabled": False},
        manager={"num_env_groups": 2, "group_filter_cls": "rollstream.filtering.group_filters:EnvFailureStdGroupFilter",
                 "group_filter_config": {"std_threshold": -1.0}})
    config = load_config(config_path)
    create_pipeline_topics(kafka_broker, config.kafka)
    request = _episode_request()
    records = {"Trajectory": synthetic_trajectory(request), "EpisodeRequest": request,
               "GroupCommand": {"command": "start", "mode": "train", "group_id": 0, "created_ms": 0},
               **{k: v for k, v in _records().items() if k in ("Prompt", "Response", "Group")}}
    bad = {}
    for n, (logical, (schema, accepts, count)) in enumerate(AGENTIC_INPUTS.items()):
        others = {k: v for k, v in records.items() if k not in accepts}
        bad[logical] = malformed(schema, records[schema], others, count, seed=100 + n, expected=accepts)
    producer = make_producer(kafka_broker)
    for logical, events in bad.items():
        for _, value in events[: len(events) // 2]:
            producer.send(topics.name(logical), key=b"0", value=value)
    producer.flush()
    stages = StageProcesses(config_path, kafka_broker, tmp_path / "logs", cwd=tmp_path)
    (tmp_path / "logs").mkdir()
    try:
        for stage in (Stage.group_queue, Stage.env, Stage.trainer):
            stages.start(stage)
        start_env_groups(config, kafka_broker)
        for logical, events in bad.items():
            for _, value in events[len(events) // 2:]:
                producer.send(topics.name(logical), key=b"1", value=value)
        producer.flush()
        await_trainer(stages, tmp_path)
        dead = read_values(kafka_broker, topics.dead_letter)
        stages.check(finished=frozenset({"trainer"}))
    finally:
        producer.close()
        stages.close()
    by_topic = Counter(d["source_topic"].removeprefix(topics.prefix) for d in dead)
    print(json.dumps({"malformed_per_topic": {k: len(v) for k, v in bad.items()}, "dead_letters_per_topic": by_topic},
                     sort_keys=True))
    assert by_topic == {logical: len(events) for logical, events in bad.items()}
    assert {d["reason"] for d in dead} <= DEAD_LETTER_REASONS
    report = run_audit(kafka_broker, topics, True, tmp_path / "runs" / "it-agentic" / "batches.jsonl")
    assert report.ok, report.to_json()
    assert report.counts["groups_trained"] == 2


def await_trainer(stages: StageProcesses, tmp_path, timeout_s: float = 400) -> None:
    """Wait for the trainer to end (every other stage must stay alive meanwhile); it must exit 0."""
    deadline = time.monotonic() + timeout_s
    while stages.procs["trainer"].poll() is None and time.monotonic() < deadline:
        stages.check(finished=frozenset({"trainer"}))
        time.sleep(1)
    assert stages.procs["trainer"].returncode == 0, (tmp_path / "logs" / "trainer.log").read_text()[-3000:]
