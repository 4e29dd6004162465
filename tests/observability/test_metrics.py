"""Worker metrics and the stats view, without a broker: exact counts from real effects."""

from __future__ import annotations

from rollstream.config import parse_config
from rollstream.filtering.prompt_state import step
from rollstream.observability.metrics import VERSION_SERIES_KEPT, WorkerMetrics
from rollstream.streams.aggregator_processor import count_effects
from rollstream.tools.stats import figures, latest
from rollstream.tools.summary import weight_updates


def rewarded(pid: str, index: int, reward: float, finish: str = "stop", mode: str = "train") -> dict:
    return {"response": {"prompt_id": pid, "domain": "synth", "mode": mode, "sample_index": index,
                         "finish_reason": finish, "response_length": 1, "policy_version": 0},
            "response_level_reward": reward, "scores": {}}


def test_prompt_effects_count_every_unit_and_reward_scope():
    cfg = parse_config({"name": "m", "rollout_batch_size": 1, "num_return_sequences_in_group": 2,
                        "max_prompts_per_batch": 4, "datasets": [],
                        "rewards": {"synth": {"reward_type": "gsm8k",
                                              "query_filter_config": {"type": "std_filter", "filter_args": {"std_threshold": 0.0}}}}})
    filters = cfg.domain_filters()["synth"]
    metrics = WorkerMetrics("w1")
    script = [("a", rewarded("a", 0, 1.0)), ("a", rewarded("a", 1, 0.0, "error")),  # engine_error -> round 2
              ("a", rewarded("a", 2, 0.0)), ("b", rewarded("b", 0, 0.0)), ("b", rewarded("b", 1, 0.0)),
              ("v", rewarded("v", 0, 1.0, mode="val"))]
    states = {}
    for pid, record in script:
        states[pid], effects = step(states.get(pid), record, filters)
        count_effects(metrics, effects, record["response"]["mode"])
    view = figures(latest(metrics.snapshot(now_ms=5)))
    assert view["units"]["response"] == {"accepted": 5.0, "rejected": 1.0, "reasons": {"engine_error": 1.0},
                                         "retention": round(5 / 6, 4)}
    assert view["units"]["query"] == {"accepted": 1.0, "rejected": 1.0, "reasons": {"zero_std": 1.0}, "retention": 0.5}
    assert view["replacement_rounds"] == 1.0
    assert view["reward"] == {"all": 0.25, "accepted": 0.5}  # a: [1, 0] kept; b: [0, 0]
    assert view["validation"] == {"original": 1.0, "accepted": 1.0, "rejected": 0.0}
    # the learning figures by policy version: the kept responses of decided groups
    assert view["by_policy_version"] == {"train": {"0": {"responses": 4, "reward_mean": 0.25, "positive_share": 0.25}},
                                         "val": {"0": {"responses": 1, "reward_mean": 1.0, "positive_share": 1.0}}}


def test_stats_keep_the_newest_sample_per_worker_and_sum_over_workers():
    def sample(worker, value, at):
        return {"worker": worker, "name": "rollstream_decided_total", "value": value, "created_ms": at,
                "labels": {"unit": "group", "outcome": "accepted"}}
    records = [sample("w1", 3, 10), sample("w1", 5, 20), sample("w1", 4, 15), sample("w2", 2, 30),
               {"worker": "gq", "name": "group_queue/groups", "value": 1, "created_ms": 1, "labels": {}}]
    assert latest(records) == {("rollstream_decided_total", (("outcome", "accepted"), ("unit", "group"))): 7.0}


def test_per_version_series_stay_bounded_and_stats_keep_every_versions_last_value():
    """A run of any length holds at most VERSION_SERIES_KEPT versions' series (the soak's
    aggregator grew ~10 MB/h with one series per version over 3,000 versions); each dropped
    series was published with its final value first, so stats still shows every version."""
    metrics, published = WorkerMetrics("agg"), []
    versions = 3 * VERSION_SERIES_KEPT
    for version in range(versions):
        metrics.version_rewards("train", version, [1.0, 0.0, 1.0])
        metrics.version_rewards("train", version, [0.0])
        metrics.weight_update("http://s1", version, "inplace", 12.0 + version)
        if version % 7 == 0:
            published += metrics.snapshot(now_ms=version)
    published += metrics.snapshot(now_ms=versions)
    held = {labels["policy_version"] for name, labels, _ in metrics.samples() if name.startswith("rollstream_version_")}
    assert held == {str(v) for v in range(versions - VERSION_SERIES_KEPT, versions)}
    assert len({labels["version"] for name, labels, _ in metrics.samples()
                if name == "rollstream_weight_update_ms"}) == VERSION_SERIES_KEPT
    view = figures(latest(published))["by_policy_version"]["train"]
    assert sorted(map(int, view)) == list(range(versions))
    assert all(row == {"responses": 4, "reward_mean": 0.5, "positive_share": 0.5} for row in view.values())
    assert [u["ms"] for u in weight_updates(published)] == [12.0 + v for v in range(versions)]
    # a group of a frozen version is not counted, nor does it bring the series back from zero
    metrics.version_rewards("train", 0, [1.0])
    assert not any(labels.get("policy_version") == "0" for _, labels, _ in metrics.samples())
