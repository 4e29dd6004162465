"""Every benchmark under benchmarks/ at its smallest size (``--smoke``): the real broker, real
stages and the real model on a tiny workload, its JSON written and its keys checked, so a
benchmark that breaks fails the suite. The figures themselves are never asserted (they are
`make bench`'s); correctness flags the scripts compute are. The runs start in the background at
the session's start (the ``benchmark_smoke`` fixture, tests/conftest.py); these tests read them
at the end."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.processes import run_script, tail

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration


def run_benchmark(name: str, tmp_path: Path, *args: str, timeout: float = 600) -> dict:
    """Run ``benchmarks/<name>.py --smoke`` with ``args``; the JSON it wrote to ``--out``."""
    out, log = tmp_path / f"{name}.json", tmp_path / f"{name}.log"
    try:
        code = run_script([sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), "--smoke", "--out", str(out), *args],
                          log, timeout_s=timeout)
    except TimeoutError as e:
        pytest.fail(f"{name} --smoke {e}")
    assert code == 0, tail(log)
    result = json.loads(out.read_text())
    assert result["smoke"] is True
    return result


@pytest.mark.benchmark_smoke("filter_stage", "--bootstrap", "{kafka_broker}")
def test_filter_stage(benchmark_smoke):
    r = benchmark_smoke
    assert (r["responses"], r["prompts"], r["broker"]) == (16, 4, "external")
    assert (r["expected_accepted"], r["expected_rejected"]) == (2, 2)
    assert (r["inprocess_accepted"], r["inprocess_rejected"]) == (2, 2)
    assert r["correct"] is True and r["kafka_correct"] is True
    for key in ("avro_encode_per_s", "avro_decode_per_s", "inprocess_responses_per_s", "kafka_startup_s"):
        assert r[key] > 0, key
    assert "kafka_responses_per_s" in r  # None when every outcome came in one poll (no span to time)


@pytest.mark.benchmark_smoke("group_latency", "--bootstrap", "{kafka_broker}")
def test_group_latency(benchmark_smoke):
    r = benchmark_smoke
    assert (r["groups"], r["groups_measured"], r["batches"], r["broker"]) == (8, 8, 2, "external")
    assert r["correct"] and r["groups_trained_once"]
    for figure in ("latency_ms", "decision_ms", "delivery_ms"):
        p = r[figure]
        assert p["p50"] <= p["p90"] <= p["p99"] <= p["max"], (figure, p)


@pytest.mark.benchmark_smoke("startup", "--bootstrap", "{kafka_broker}")
def test_startup(benchmark_smoke):
    r = benchmark_smoke
    assert r["correct"], r["stages"]
    assert set(r["stages"]) == {"admission", "generation", "reward", "aggregator", "group-queue"}
    assert all(f["first_output_s"] > 0 and f["import_s"] > 0 for f in r["stages"].values())


@pytest.mark.benchmark_smoke("agentic", "--bootstrap", "{kafka_broker}")
def test_agentic(benchmark_smoke):
    r = benchmark_smoke
    assert r["groups"] == 2 and r["correct"] is True and r["kafka_correct"] is True
    assert r["env_player_correct"] is True
    assert (r["kafka_accepted"], r["kafka_late"], r["kafka_error"]) == (4, 4, None)
    for key in ("group_queue_inprocess_trajectories_per_s_default", "group_queue_inprocess_trajectories_per_s_std",
                "kafka_startup_s"):
        assert r[key] > 0, key
    assert "group_queue_kafka_trajectories_per_s" in r  # None when every group came in one poll
    assert {"env_player_same_tokens", "env_player_speedup"} <= set(r)


@pytest.mark.benchmark_smoke("corrections")
def test_corrections(benchmark_smoke):
    r = benchmark_smoke
    assert (r["batch"], r["tokens_per_row"]) == (4, 64)
    assert set(r["cpu"]) == set(r["loop_reference"]) == {"token", "segment", "geometric", "sequence"}
    assert r["agree"] is True
    assert all(v["tokens_per_s"] > 0 for v in r["cpu"].values())


@pytest.mark.benchmark_smoke("cpu_sharing")
def test_cpu_sharing(benchmark_smoke):
    r = benchmark_smoke
    [(name, variant)] = r["variants"].items()
    assert (name, variant["omp_wait_policy"]) == ("shared_passive", "PASSIVE")
    assert variant["step_seconds_median"] > 0 and variant["generator_calls_per_s"] >= 0


@pytest.mark.benchmark_smoke("generation_batch")
def test_generation_batch(benchmark_smoke):
    r = benchmark_smoke
    assert (r["rows"], r["max_new_tokens"]) == (4, 2)
    assert set(r["by_max_num_seqs"]) == {"1", "4"}
    assert all(v["seconds_median"] > 0 and v["prefill_per_row"]["seconds_median"] > 0
               for v in r["by_max_num_seqs"].values())


@pytest.mark.benchmark_smoke("real_sizes")
def test_real_sizes(benchmark_smoke):
    r = benchmark_smoke
    [case] = r["cases"]
    assert (case["group_size"], case["response_tokens"], case["prompts"]) == (2, 64, 2)
    assert case["completed"] is True and (case["groups_accepted"], case["groups_rejected"]) == (1, 1)
    for key in ("payload_mb", "bytes_written_per_payload_byte", "aggregator_peak_rss_mb", "trainer_fetch_mb_per_s",
                "decision_event_max_bytes", "changelog_value_max_bytes"):
        assert key in case, key
    assert r["aggregator_import_rss_mb"] > 0


@pytest.mark.benchmark_smoke("real_sizes", "--rss-responses", "16,32")
def test_real_sizes_rss(benchmark_smoke):
    """The RSS-flatness mode: the aggregator's RSS after each count of small responses."""
    r = benchmark_smoke
    assert r["rss_group_size"] == 8 and set(r["rss_mb_after"]) == {"16", "32"}
    assert all(mb > 0 for mb in r["rss_mb_after"].values())
    assert "cases" not in r


@pytest.mark.benchmark_smoke("learning", timeout=900)
def test_learning(benchmark_smoke):
    r = benchmark_smoke
    assert (r["max_steps"], r["seeds"]) == (1, [1])
    assert set(r["variants"]) == {"no_filter", "trl_grpo"}
    for name, variant in r["variants"].items():
        [run] = variant["runs"]
        assert run["outcome"] in ("complete", "end_of_data"), (name, run)
        assert [v["policy_version"] for v in run["validation"]] == [0, 1], name
        assert run["responses_generated"] == 2, name
        assert {"seconds_to_val_0_9", "seconds_to_val_0_9_validation_inside", "responses_to_val_0_9",
                "wall_seconds"} <= set(run)
        # both clocks at every round: the version was made before its score was known
        assert all(0 <= v["seconds"] <= v["validated_seconds"] for v in run["validation"]), (name, run["validation"])
    assert r["variants"]["trl_grpo"]["runs"][0]["engine"].startswith("transformers")
    assert r["variants"]["no_filter"]["runs"][0]["startup_seconds"]["first_token"] > 0


@pytest.mark.vllm
def test_engine(kafka_broker, vllm_server, tmp_path):
    r = run_benchmark("engine", tmp_path, "--server", vllm_server.url, "--bootstrap", kafka_broker, timeout=900)
    assert (r["prompts"], r["n"], r["max_new_tokens"], r["pipeline_max_batch"]) == (4, 2, 8, 2)
    assert r["bare_tokens"] > 0 and r["pipeline_tokens"] > 0 and r["pipeline_error_responses"] == 0
    assert r["pipeline_over_bare"] > 0 and r["transformers_prompts"] == 1 and r["transformers_tokens_per_s"] > 0
    for way in ("bare", "pipeline"):
        assert {f"{way}_server_busy_fraction", f"{way}_server_running_mean"} <= set(r), way
    assert r["weights_135m"]["logprobs_changed_each_time"] is True
    assert len(r["weights_135m"]["weight_update_ms"]) == 1 and r["weights_135m"]["checkpoint_mb"] > 0
    assert r["weights_135m"]["parameters_m"] > 100 > r["weights_large"]["parameters_m"] > 0  # --smoke: tiny, not served
    assert r["weight_update_ms"] == {"135m": r["weights_135m"]["weight_update_ms"], "large": None}
    assert r["correction_filters"] and set(r["mismatch"]) == {"vllm", "transformers"}
    for engine, m in r["mismatch"].items():
        assert 1 <= m["rows"] <= 2 and m["tokens"] > 0 and 0 <= m["drop_fraction"] <= 1, engine
        assert set(m["drop_by_filter"]) == {"0:token", "1:geometric"}, engine


@pytest.mark.benchmark_smoke("filtering", "--base", "examples/rlvr_mixed.yaml", timeout=600)
def test_filtering(benchmark_smoke, tmp_path):
    r = benchmark_smoke
    assert (r["max_steps"], r["seeds"], r["screening_samples"], r["config"]) == (1, [1], 2, "examples/rlvr_mixed.yaml")
    w = r["workload"]
    assert set(w["domains"]) == {"arithmetic", "arithmetic_4digit"}
    assert len(w["pass_rate_histogram_v0"]) == w["samples"] + 1 and sum(w["pass_rate_histogram_v0"]) == w["prompts"]
    assert 0 <= w["zero_variance_share_v0"] <= 1 and set(w["learnable_domains"]) <= set(w["domains"])
    assert set(r["variants"]) == {"no_filter", "screening_history", "trl_grpo"}
    assert {"val_accuracy", "rule"} <= set(r["target"])
    figures = {"seconds_to_target", "seconds_to_target_validation_inside", "tokens_to_target",
               "final_val_accuracy", "final_learnable_val_accuracy", "val_accuracy_at_budget", "tokens_generated",
               "share_of_tokens_trained_on", "tokens_per_version"}
    for name, variant in r["variants"].items():
        assert figures <= set(variant), name
        assert all(set(variant[k]) == {"values", "mean", "stdev"} and len(variant[k]["values"]) == 1 for k in figures)
        [run] = variant["runs"]
        assert run["outcome"] in ("complete", "end_of_data"), (name, run)
        assert run["validation"][0]["policy_version"] == 0, name
        assert all(0 <= v["seconds"] <= v["validated_seconds"] for v in run["validation"]), (name, run["validation"])
        assert run["tokens_generated"] > 0 and all(v.isdigit() for v in run["tokens_by_version"]), name
        # what a version cost (none where a run trained no step: screening may reject every prompt)
        per_version = round(run["tokens_generated"] / run["steps"], 1) if run["steps"] else None
        assert variant["tokens_per_version"]["values"] == [per_version], name
    assert r["variants"]["no_filter"]["tokens_per_version"]["values"][0] > 0
    # 4 new tokens never sum two 4-digit numbers: those groups end at their screening round
    screened = r["variants"]["screening_history"]["runs"][0]
    assert "screened_out" in screened["groups_rejected"], screened["groups_rejected"]
    assert set(screened["difficulty"]) >= {"groups_generated", "zero_variance_share", "share_of_tokens_trained_on"}
    assert screened["screening"]["screened_out"] == screened["groups_rejected"]["screened_out"]
    assert (r["diagnose"], screened["screening"]["checked_in_full"]) == (False, 0)
    assert [v["policy_version"] for v in r["variants"]["no_filter"]["runs"][0]["validation"]] == [0, 1]
    # one evaluator for every variant, after the run or between TRL's steps: version 0 is the same
    # weights and seed everywhere, so the same figures (the second rollstream variant reuses the
    # first one's row, its round time too; TRL validates in its own process)
    v0 = {name: {k: v["runs"][0]["validation"][0][k] for k in ("val_accuracy", "domains")}
          for name, v in r["variants"].items()}
    assert v0["no_filter"] == v0["screening_history"] == v0["trl_grpo"], v0
    assert screened["validation"][0] == r["variants"]["no_filter"]["runs"][0]["validation"][0]
    comparison = r["comparison"]
    assert set(comparison) == {"screening_history_over_no_filter", "screening_history_sooner_than_trl_grpo"}
    assert set(comparison["screening_history_over_no_filter"]) == {"tokens_to_target", "seconds_to_target",
                                                                   "tokens_per_version", "version_to_target"}
    assert "plots" not in r  # --smoke draws none unless asked
    assert r["complete"] is True
    # --resume on a finished report keeps every run and the v0 probe: nothing runs again
    (tmp_path / "filtering.json").write_text(json.dumps(r))
    again = run_benchmark("filtering", tmp_path, "--base", "examples/rlvr_mixed.yaml", "--resume", timeout=120)
    assert (again["workload"], again["variants"], again["comparison"]) == (r["workload"], r["variants"], r["comparison"])


@pytest.mark.benchmark_smoke("soak", timeout=600)
def test_soak(benchmark_smoke):
    """A minute of the pipeline, three faults: whatever the timings, nothing accepted is lost,
    every malformed event is dead-lettered and the report has every figure."""
    r = benchmark_smoke
    assert (r["outcome"], r["audit_ok"], r["failed_checks"]) == ("end_of_data", True, []), r
    assert [f["kind"] for f in r["faults"]] == ["kill:aggregator", "malformed", "reward_hang"]
    assert r["stage_restarts"] == {"aggregator": 1}
    assert r["events_dead_lettered"] == r["malformed_sent"] == 40  # each malformed event once, whatever redelivered
    assert r["counts"]["groups_rejected_by_trainer"] == 0 and r["counts"]["groups_trained"] > 0
    assert r["goals"]["audit_ok"] and r["goals"]["dead_letters_are_the_bursts"]
    assert len(r["samples"]) >= 6 and set(r["samples"][0]["processes"]) >= {
        "admission", "aggregator", "generation", "reward", "trainer", "broker"}
    assert {"rss_slope_mb_per_h", "disk_bytes_by_topic", "p99_latency_ms", "lag", "decisions_per_s"} <= set(r)
    assert set(r["disk_bytes_by_topic"]["last"]) >= {"responses", "groups.accepted"}
