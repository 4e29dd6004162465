"""The filtering benchmark on stored curves: its comparison of (d) against (a), where a seed that
(a) never brought to the target still says how far below 1 (d)'s ratio is at most; and the runs
``--resume`` keeps."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def filtering(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # the benchmark sets it on import; restored after
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("filtering")


def run(seed: int, curve: list[tuple[int, float, float]], tokens_per_version: int) -> dict:
    """A stored run: validation rows (version, accuracy, seconds), the same tokens for every version."""
    last = curve[-1][0]
    return {"seed": seed, "steps": last, "tokens_generated": tokens_per_version * last,
            "tokens_by_version": {str(v): tokens_per_version for v in range(last)},
            "validation": [{"policy_version": v, "val_accuracy": a, "seconds": t, "validated_seconds": t + 1,
                            "domains": {}} for v, a, t in curve]}


def test_a_seed_the_baseline_never_brought_to_the_target_is_bounded_by_its_whole_run(filtering):
    runs = {
        # (a): seed 1 ends at 0.1, seed 2 at 0.3: the target is 0.2, which seed 1 never reaches
        "no_filter": [run(1, [(0, 0.0, 0.0), (4, 0.1, 40.0), (8, 0.1, 80.0)], 100),
                      run(2, [(0, 0.0, 0.0), (4, 0.2, 40.0), (8, 0.3, 80.0)], 100)],
        "screening_history": [run(1, [(0, 0.0, 0.0), (4, 0.25, 30.0)], 50),
                              run(2, [(0, 0.0, 0.0), (4, 0.25, 30.0)], 50)],
    }
    target, figures = filtering.report_variants(runs, {})
    assert target == 0.2
    assert figures["no_filter"]["tokens_to_target"]["values"] == [None, 400]
    over = filtering.compare(figures, [1, 2])["screening_history_over_no_filter"]
    assert over["tokens_to_target"]["per_seed"] == [None, 0.5]  # 200 of 400 tokens
    # seed 1: (a) spent 800 tokens and 80 s without reaching it, (d) reached it with 200 and 30
    assert over["tokens_to_target"]["at_most_per_seed"] == [0.25, 0.5]
    assert over["seconds_to_target"]["at_most_per_seed"] == [0.375, 0.75]
    # the means: (a)'s over seed 2 alone (400 tokens) against (d)'s over both (200): 0.5; counting
    # seed 1 at the 800 tokens it spent, (a)'s mean is at least 600: the ratio at most 1/3
    assert (over["tokens_to_target"]["mean"], over["tokens_to_target"]["at_most"]) == (0.5, 0.333)
    assert (over["seconds_to_target"]["mean"], over["seconds_to_target"]["at_most"]) == (0.75, 0.5)


def test_resume_keeps_the_runs_of_a_report_made_with_the_same_settings(filtering, tmp_path):
    settings = {"smoke": False, "config": "examples/rlvr_mixed.yaml", "max_steps": 8, "screening_samples": 4,
                "diagnose": False}
    runs = {"no_filter": [run(1, [(0, 0.0, 0.0), (4, 0.1, 40.0), (8, 0.3, 80.0)], 100)]}
    workload = {"samples": 16, "domains": {}}
    out = tmp_path / "filtering.json"
    assert filtering.earlier(out, settings) == (None, {})  # nothing yet: every run is to do
    filtering.write(out, filtering.report(settings, [1], workload, runs, {}, complete=False))
    stored = json.loads(out.read_text())
    assert (stored["complete"], stored["max_steps"], stored["target"]["val_accuracy"]) == (False, 8, 0.3)
    assert filtering.earlier(out, settings) == (workload, json.loads(json.dumps(runs)))
    with pytest.raises(ValueError, match=r"other settings \{'max_steps': \{'there': 8, 'now': 24\}\}"):
        filtering.earlier(out, {**settings, "max_steps": 24})
    # a report whose runs were validated another way (validation inside the run, say) is refused
    with pytest.raises(ValueError, match=r"other settings \{'validation': \{'there': None, 'now': .one evaluator"):
        filtering.earlier(out, {**settings, "validation": filtering.VALIDATION})


def test_version_0_is_validated_once_a_seed_and_its_round_still_counts(filtering):
    """Every rollstream variant of a seed starts from the same weights and validates them with the
    same seed: the first run's row is reused, its round time kept for the validation-inside clock.
    TRL's rows and rows stored before round_seconds existed are not taken."""
    row = {"policy_version": 0, "val_accuracy": 0.25, "domains": {"a": 0.25}, "seconds": 0.0,
           "validated_seconds": 40.0, "round_seconds": 40.0}
    trl = {"seed": 1, "validation": [{**row, "val_accuracy": 0.5}]}
    old = {"seed": 2, "validation": [{k: v for k, v in row.items() if k != "round_seconds"}]}
    runs = {"trl_grpo": [trl], "no_filter": [old, {"seed": 1, "validation": [row]}], "screening_history": []}
    assert filtering.known_v0(runs, 1) == row
    assert filtering.known_v0(runs, 2) is None and filtering.known_v0(runs, 3) is None


def test_a_seed_trl_has_not_run_yet_is_no_verdict_against_it(filtering):
    """A seed TRL never reached counts for (d); a seed TRL has not run (a partial report) is None."""
    runs = {"no_filter": [run(1, [(0, 0.0, 0.0), (4, 0.2, 40.0)], 100), run(2, [(0, 0.0, 0.0), (4, 0.2, 40.0)], 100)],
            "screening_history": [run(1, [(0, 0.0, 0.0), (4, 0.25, 30.0)], 50),
                                  run(2, [(0, 0.0, 0.0), (4, 0.25, 30.0)], 50)],
            "trl_grpo": [run(1, [(0, 0.0, 0.0), (4, 0.1, 50.0)], 100)]}
    _, figures = filtering.report_variants(runs, {})
    assert filtering.compare(figures, [1, 2, 3])["screening_history_sooner_than_trl_grpo"]["per_seed"] == [True, None, None]
