"""Which payloads the trainer may delete (rollstream.trainer.retention): the readers' watch, the
time cut and the offsets a held group protects. Times in ms."""

from __future__ import annotations

from rollstream.config import parse_config
from rollstream.trainer.retention import (
    AGENTIC_READERS,
    CHECK_SLACK_MS,
    CURRENT_WITHIN_MS,
    DEFAULT_KEEP_MS,
    RLVR_READERS,
    PayloadRetention,
    ReaderWatch,
    cut_offsets,
    is_current,
    payload_horizon_ms,
)

NOW = 100_000_000
POLICY = PayloadRetention(keep_ms=0, completion_ms=300_000, every_s=30.0, skew_ms=60_000)


def test_readers_are_current_when_every_oldest_unread_record_is_recent():
    assert is_current([], NOW) and is_current([NOW - CURRENT_WITHIN_MS, NOW], NOW)
    assert not is_current([NOW, NOW - CURRENT_WITHIN_MS - 1], NOW)


def test_the_watch_counts_unbroken_currency_and_a_lag_or_a_long_gap_breaks_it():
    watch = ReaderWatch(max_gap_ms=40_000)
    assert watch.current_for_ms(NOW) is None  # never checked
    for t in range(0, 120_001, 30_000):
        watch.observe(NOW + t, True)
    assert watch.current_for_ms(NOW + 120_000) == 120_000
    assert watch.current_for_ms(NOW + 170_000) is None  # the last check is too old to say
    watch.observe(NOW + 150_000, False)  # a reader fell behind
    assert watch.current_for_ms(NOW + 150_000) is None
    watch.observe(NOW + 180_000, True)
    assert watch.current_for_ms(NOW + 200_000) == 20_000
    watch.observe(NOW + 250_000, True)  # 70 s after the last check: nothing is known in between
    assert watch.current_for_ms(NOW + 250_000) == 0


def test_the_time_cut_waits_for_the_readers_and_keeps_two_margins_the_completion_bound_and_keep_ms():
    margin = 30_000 + CHECK_SLACK_MS + CURRENT_WITHIN_MS
    assert POLICY.margin_ms == margin == 120_000
    assert payload_horizon_ms(NOW, POLICY, None) is None  # readers not current
    assert payload_horizon_ms(NOW, POLICY, 300_000 + margin - 1) is None  # not for long enough
    assert payload_horizon_ms(NOW, POLICY, 300_000 + margin) == NOW - 300_000 - 2 * margin - 60_000
    long_keep = PayloadRetention(keep_ms=3_600_000, completion_ms=300_000, every_s=30.0, skew_ms=60_000)
    assert payload_horizon_ms(NOW, long_keep, 10**9) == NOW - 3_600_000 - 60_000
    assert payload_horizon_ms(NOW, PayloadRetention(keep_ms=-1), 10**9) is None  # keep forever
    # without readers no stage upstream holds a group: no wait, no margin
    alone = PayloadRetention(keep_ms=0, completion_ms=300_000, readers=(), skew_ms=0)
    assert (alone.margin_ms, payload_horizon_ms(NOW, alone, None)) == (0, NOW - 300_000)


def test_a_cut_never_passes_a_reference_of_a_held_group():
    time_cuts = {("r", 0): 12, ("r", 1): 5, ("t", 0): 0}
    held = [("r", 0, 8), ("r", 0, 9), ("r", 1, 7), ("x", 0, 1)]  # ("x", 0): no payload partition of ours
    assert cut_offsets(time_cuts, held) == {("r", 0): 8, ("r", 1): 5, ("t", 0): 0}


def test_a_config_gives_its_keep_its_completion_bound_and_its_pipelines_readers():
    base = {"rollout_batch_size": 2, "num_return_sequences_in_group": 4, "max_prompts_per_batch": 4,
            "rewards": {"math": {"reward_type": "gsm8k"}}, "datasets": [], "prompt_timeout_s": 60,
            "max_response_rounds": 3, "max_reissues_per_prompt": 1}
    assert PayloadRetention.of(parse_config(base)) == PayloadRetention(DEFAULT_KEEP_MS, 240_000, RLVR_READERS)
    short = PayloadRetention.of(parse_config({**base, "kafka": {"payload_retention_ms": 1_000}}))
    assert (short.keep_ms, short.completion_ms) == (1_000, 240_000)
    agentic = parse_config({"rollout_batch_size": 4, "custom_envs": {"lake": {"env_type": "frozen_lake"}},
                            "train_env_manager": {"num_env_groups": 2, "group_size": 2, "tags": ["lake"],
                                                  "episode_timeout_s": 100, "max_reissues_per_episode": 1}})
    assert PayloadRetention.of(agentic) == PayloadRetention(DEFAULT_KEEP_MS, 400_000, AGENTIC_READERS)  # 2 refills
