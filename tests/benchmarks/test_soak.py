"""The soak's pure parts: its reward functions against the prompts it really sends, and its
figures from samples."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from soak import RSS_SETTLE_S, figures, latency_windows, parse, prompt_pool, topic_label  # noqa: E402
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


def test_latency_windows_are_fault_rounds_from_the_warm_up_and_the_last_may_be_cut_by_the_end():
    """Windows that hold different faults are not comparable (the hour's soak: minutes 10-20 held
    two stage kills, minutes 50-60 a trainer kill, a broker stop and a hang): by default a window
    is one round of the faults, from the warm-up's end."""
    args = parse([])
    assert args.window_s == len(args.faults) * args.fault_every_s == 1800.0
    start_ms = 1_000_000
    latency_ms = {100: 9000, 400: 1000, 2000: 1000, 2200: 2000, 3500: 2000}  # commit second -> latency
    groups = [(start_ms + t * 1000 - ms, start_ms + t * 1000) for t, ms in latency_ms.items()]
    windows = latency_windows(groups, start_ms, 1800.0, offset_s=300.0)
    assert [(w["from_s"], w["groups"]) for w in windows] == [(0.0, 1), (300.0, 2), (2100.0, 2)]
    before = latency_windows([(start_ms, start_ms + t * 1000) for t in (10, 100, 200, 400)], start_ms, 60.0, 300.0)
    assert [(w["from_s"], w["groups"]) for w in before] == [(0.0, 3), (360.0, 1)]  # one window before the offset
    p99 = figures([], windows, [], warmup_s=300.0, window_s=1800.0, duration_s=3600.0)["p99_latency_ms"]
    assert p99 == {"first_window": 1000.0, "last_window": 2000.0}  # the second round, cut at 3600 s, counts
    p99 = figures([], windows, [], warmup_s=300.0, window_s=1800.0, duration_s=2900.0)["p99_latency_ms"]
    assert p99 == {"first_window": 1000.0, "last_window": 1000.0}  # less than half of it came before the end
