"""The soak's pure parts: its reward functions against the prompts it really sends, and its
figures from samples."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from soak import RSS_SETTLE_S, figures, prompt_pool, topic_label  # noqa: E402
from soak_rewards import last_number  # noqa: E402


def test_last_number_reads_the_answer_of_a_reasoning_gym_ground_truth():
    """The model soak's reward once compared replies with the whole task entry (JSON): every
    group scored 0, was rejected mean_too_low, and the trainer ended batch_underfilled at once."""
    prompt = prompt_pool()[0]  # "Calculate 5 - 3. ...", its answer 2
    assert prompt["prompt"].startswith("Calculate 5 - 3.")
    assert last_number("5 - 3 = 2", prompt["ground_truth"]) == 1.0
    assert last_number("The answer is 3", prompt["ground_truth"]) == 0.0
    assert last_number("no number", prompt["ground_truth"]) == 0.0
    assert last_number("so 12", "12") == 1.0


def _sample(t_s: float, pid: int, rss_mb: float, floor_mb: float) -> dict:
    return {"t_s": t_s, "processes": {"trainer": {"pid": pid, "rss_mb": rss_mb, "rss_floor_mb": floor_mb, "fds": 40}},
            "lag": None, "disk_bytes": {}, "responses_written": None, "decisions_per_s": None}


def test_the_rss_slope_fits_each_lifes_floor_after_it_settles():
    """Transient batches make single readings jump by tens of MB (the hour's soak: +-20 MB), and a
    process climbs for minutes after it starts: neither is a leak. The slope is fitted to the
    floor, within each life, from RSS_SETTLE_S of its age on."""
    samples = []
    for pid, born in ((1, 0.0), (2, 2400.0)):  # a restart at 40 min
        for minute in range(40):
            t = born + 60.0 * minute
            warm = min(t - born, RSS_SETTLE_S) / RSS_SETTLE_S * 30  # +30 MB while it settles
            floor = 900 + warm + (t - born) / 3600 * 2.0  # then 2 MB/h
            samples.append(_sample(t, pid, floor + (25 if minute % 2 else 0), floor))
    report = figures(samples, [], [], warmup_s=0.0, window_s=600.0, duration_s=4800.0)
    assert abs(report["rss_slope_mb_per_h"]["trainer"] - 2.0) < 0.01


def test_disk_is_reported_by_logical_topic_with_changelogs_and_the_brokers_own_apart():
    assert topic_label("soak.responses", "soak.") == "responses"
    assert topic_label("soak.aggregator-prompt-state-changelog", "soak.") == "changelogs"
    assert topic_label("__consumer_offsets", "soak.") == "__consumer_offsets"
    assert topic_label("soak.aggregator-__assignor-__leader", "soak.") == "(other)"
