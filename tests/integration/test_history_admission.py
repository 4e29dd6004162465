"""History-aware admission on the real broker (``history_filter``, GRESO): a scripted history
(half the prompts always all-correct, half always mixed) over three epochs, with the admission
restarted between the first epoch and the others, so the later epochs can only know the history
from the compacted ``prompt.history`` topic. Skips follow the rule exactly (the draws are
seeded; the test recomputes them with the pure functions), every (prompt, epoch) is generated
or skipped exactly once, skipped prompts are rejected Groups with their reason and values."""

from __future__ import annotations

from collections import Counter

import pytest

from rollstream.app.stages import Stage
from rollstream.config import load_config
from rollstream.filtering import history as h
from rollstream.tools.readback import read_values

from .harness import SyntheticRollout, produce, prompt, start_stages, wait_for, write_config
from .test_end_of_data import end_data, verdicts

pytestmark = pytest.mark.integration

EASY = [f"easy{i}" for i in range(4)]
MIXED = [f"mix{i}" for i in range(4)]


def script(prompt_id: str, index: int, round_: int) -> tuple[float, str]:
    base, _ = h.split_epoch(prompt_id)
    return (1.0 if base in EASY else float(index == 0)), "stop"


def expected_skips(limits: h.HistoryLimits, epochs: int) -> dict[str, list[int]]:
    """prompt -> the epochs the rule skips it in, replaying the rule on the scripted history
    (p_e stays at explore_init: explore_step is 0)."""
    explore = h.ExploreState.initial(limits)
    out: dict[str, list[int]] = {}
    for pid in EASY + MIXED:
        past, skipped = h.PromptHistory(pid), []
        for epoch in range(epochs):
            if h.decide_skip(past, explore, limits, pid, epoch).skip:
                h.on_skip(past)
                skipped.append(epoch)
            else:
                past.record(epoch, h.ALL_CORRECT if pid in EASY else h.MIXED, 0)
        out[pid] = skipped
    return out


def test_history_skips_follow_the_rule_survive_a_restart_and_lose_no_prompt(kafka_broker, topic_factory, tmp_path):
    topics = topic_factory(partitions=2)
    config = write_config(tmp_path, topics, 2, rollout_batch_size=2, max_steps=100, num_epochs=3,
                          max_running_prompts=1,  # one at a time: every decision sees every earlier outcome
                          history_filter={"enable": True, "explore_init": 0.3, "explore_min": 0.3, "explore_step": 0.0,
                                          "max_skips": 1})
    limits = load_config(config).history_limits()
    skips = expected_skips(limits, 3)
    assert all(skips[p] == [] for p in MIXED)
    assert sum(len(skips[p]) for p in EASY) >= 2  # the seeded draws skip some: the test checks something
    assert all(e != 0 and [e, e + 1] != skips[p][i:i + 2] for p in EASY for i, e in enumerate(skips[p]))  # max_skips 1

    rollout = SyntheticRollout(kafka_broker, topics, script)
    rollout.start()
    stages = start_stages(config, kafka_broker, tmp_path / "logs", Stage.admission, Stage.aggregator)
    try:
        produce(kafka_broker, topics.prompts, "Prompt", [prompt(p) for p in EASY + MIXED])
        wait_for(lambda: len(read_values(kafka_broker, topics.prompt_history)) == 8, what="epoch 0's history",
                 stages=stages)
        stages.close()  # the admission restarts: its history lives on prompt.history only
        stages = start_stages(config, kafka_broker, tmp_path / "logs2", Stage.admission, Stage.aggregator)
        end_data(kafka_broker, topics, 8)
        wait_for(lambda: verdicts(kafka_broker, topics), timeout=240, what="the end-of-data verdict", stages=stages)

        generated = Counter(r["prompt_id"] for r in rollout.requests if r["round"] == 0)
        skipped_groups = [g for g in read_values(kafka_broker, topics.groups_rejected)
                          if g["reason"] == "skipped_by_history"]
        skipped = Counter(g["prompt_id"] for g in skipped_groups)
        expected_skipped = {f"{p}#e{e}" for p, es in skips.items() for e in es}
        assert set(skipped) == expected_skipped and set(skipped.values()) == {1}
        every = {p if e == 0 else f"{p}#e{e}" for p in EASY + MIXED for e in range(3)}
        assert set(generated) | set(skipped) == every and not set(generated) & set(skipped)  # none lost, none twice
        assert set(generated.values()) == {1}
        one = skipped_groups[0]
        assert one["decision_values"]["skip_probability"] == pytest.approx(0.7)  # 1 - 0.3^1
        assert one["responses"] == [] and one["responses_generated"] == 0
        # the history on the compacted topic: the newest record per prompt has every generated epoch
        newest = {r["prompt_id"]: r for r in read_values(kafka_broker, topics.prompt_history)}
        assert {p: [e["epoch"] for e in newest[p]["entries"]] for p in EASY + MIXED} == {
            p: [e for e in range(3) if e not in skips[p]] for p in EASY + MIXED}
        assert {e["pattern"] for p in EASY for e in newest[p]["entries"]} == {"all_correct"}
        [verdict] = verdicts(kafka_broker, topics)
        assert verdict["status"] == "end_of_data"
    finally:
        rollout.stop()
        stages.close()
