"""Reward metrics before and after filtering (validation untouched by filters), and a global
admission budget per policy version, rebuilt after a restart."""

from __future__ import annotations

from rollstream.config import parse_config
from rollstream.filtering.admission import AdmissionLimits, AdmissionState, admit, can_admit, on_outcome
from rollstream.filtering.prompt_state import Decided, step
from rollstream.observability.metrics import WorkerMetrics
from rollstream.streams.aggregator_processor import count_effects
from rollstream.tools.stats import figures, latest


def config(query_filter: dict):
    return parse_config({"name": "s", "rollout_batch_size": 2, "num_return_sequences_in_group": 4,
                         "val_num_return_sequences": 4, "max_prompts_per_batch": 64, "datasets": [],
                         "rewards": {"synth": {"reward_type": "gsm8k", "query_filter_config": query_filter}}})


MEAN_FILTER = {"type": "mean_filter", "filter_args": {"threshold_down": 0.0, "threshold_up": 1.0}}


def play(cfg, groups: dict[str, list[float]], mode: str, metrics: WorkerMetrics) -> dict[str, Decided]:
    filters = cfg.domain_filters()["synth"]
    out = {}
    for pid, rewards in groups.items():
        state = None
        for i, reward in enumerate(rewards):
            # a RewardedResponse: its ResponseSummary (one response token) and the payload's reference
            record = {"response": {"prompt_id": pid, "domain": "synth", "mode": mode, "sample_index": i,
                                   "finish_reason": "stop", "prompt_length": 3, "response_length": 1},
                      "response_level_reward": reward, "scores": {},
                      "payload": {"topic": "responses", "partition": 0, "offset": i, "size_bytes": 64}}
            state, effects = step(state, record, filters)
            count_effects(metrics, effects, mode)
            out.update({pid: e for e in effects if isinstance(e, Decided)})
    return out


def test_reward_all_and_accepted_are_both_reported():
    groups = {**{f"right{i}": [1.0] * 4 for i in range(15)}, **{f"wrong{i}": [0.0] * 4 for i in range(5)},
              **{f"mixed{i}": [1.0, 1.0, 0.0, 0.0] for i in range(10)}}
    metrics = WorkerMetrics("agg")
    decided = play(config(MEAN_FILTER), groups, "train", metrics)
    assert sum(d.accepted for d in decided.values()) == 10
    view = figures(latest(metrics.snapshot(now_ms=1)))
    assert view["reward"] == {"all": 0.6667, "accepted": 0.5}
    assert view["units"]["query"]["reasons"] == {"mean_too_high": 15.0, "mean_too_low": 5.0}


def test_validation_is_identical_with_filters_on_and_off():
    val = {f"v{i}": [float(i % 2), 0.0, 1.0, float(i % 3 == 0)] for i in range(20)}
    on, off = WorkerMetrics("on"), WorkerMetrics("off")
    with_filters = play(config(MEAN_FILTER), val, "val", on)
    without = play(config({"type": "no_filter"}), val, "val", off)
    assert with_filters == without and all(d.accepted for d in with_filters.values())
    assert figures(latest(on.snapshot(1)))["validation"] == figures(latest(off.snapshot(1)))["validation"] == {
        "original": 20.0, "accepted": 20.0, "rejected": 0.0}


def test_the_budget_is_global_per_policy_version():
    """max_staleness 0, batch 2, version 0: p0 and p1 (different partitions downstream) are both
    admitted by the single admission writer, the batch completes, and nothing is refused."""
    limits = AdmissionLimits(rollout_batch_size=2, max_running_prompts=8, max_prompts_per_batch=8, max_staleness=0)
    state = AdmissionState()
    for pid in ("p0", "p1"):
        assert can_admit(state, limits, "train", policy_version=0)
        state = admit(state, pid)
    assert not can_admit(state, limits, "train", policy_version=0)  # the batch is covered
    for pid in ("p0", "p1"):
        state, effects = on_outcome(state, limits, pid, True, "accepted")
    assert state.step == 1 and [type(e).__name__ for e in effects] == ["StepComplete"]


def test_a_restart_at_version_50_rebuilds_a_budget_of_one_batch():
    limits = AdmissionLimits(rollout_batch_size=2, max_running_prompts=8, max_prompts_per_batch=8, max_staleness=0)
    state = AdmissionState.from_dict(AdmissionState(step=50).to_dict())  # restored, nothing in flight
    admitted = 0
    while can_admit(state, limits, "train", policy_version=50):
        state = admit(state, f"p{admitted}")
        admitted += 1
    assert admitted == 2  # (0 + 1) x 2, not (0 + 50 + 1) x 2


def test_pass_at_k_is_the_unbiased_estimator():
    from rollstream.tools.stats import pass_at_k
    from rollstream.tools.learning import pass_at_ks as _pass_at_k

    assert pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 1, 1) == 0.25 and pass_at_k(4, 0, 4) == 0.0
    assert round(pass_at_k(4, 1, 2), 4) == 0.5  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert _pass_at_k([[True, False, False, False], [False] * 4]) == {"pass@1": 0.125, "pass@4": 0.5}
