"""Experiment trackers: names and values from a manifest entry and a run summary (pure); the
fan-out, where a failing, hung or missing tracker never holds up or stops a step; and each
backend's own files read back with its own reader, offline (TensorBoard's EventAccumulator, a
WANDB_MODE=offline run through `wandb leet inspect`, an MLflow file store through MlflowClient)."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from rollstream.exceptions import ConfigError
from rollstream.observability import trackers as trackers_module
from rollstream.observability.metrics import step_metrics
from rollstream.observability.trackers import (
    Trackers,
    check_installed,
    flat_params,
    process_trackers,
    summary_values,
    tracker_key,
    validation_values,
)
from tests.observability.tracker_files import (
    assert_holds,
    expected_points,
    mlflow_points,
    mlflow_run,
    tensorboard_points,
    wandb_points,
    wandb_records,
)

# two committed steps as the trainer's manifest has them (figures of a real e2e run)
ENTRIES = [
    {"step": 0, "status": "complete", "accepted_groups": 2, "fill_seconds": 12.25, "loss": -0.0125, "skipped": False,
     "policy_version": 1, "final_mask_mean": 1.0, "mask_collapse": False, "reward_mean": 0.375, "grad_norm": 0.8125,
     "pg_clipfrac": 0.0, "policy_lag_max": 0, "train_seconds": 3.5,
     "pass_rates": {"actor/train_infer_token_ratio_mask_mean@sum": 1.0},
     "ratio_means": {"token": 1.0001, "sequence": 0.9998}, "diff_means": {"token": 0.0002}},
    {"step": 1, "status": "complete", "accepted_groups": 2, "fill_seconds": 4.5, "loss": 0.03125, "skipped": False,
     "policy_version": 2, "final_mask_mean": 0.75, "mask_collapse": True, "reward_mean": 0.5, "grad_norm": 1.25,
     "pg_clipfrac": 0.125, "policy_lag_max": 1, "train_seconds": 2.75,
     "pass_rates": {"actor/train_infer_token_ratio_mask_mean@sum": 0.75},
     "ratio_means": {"token": 1.25, "sequence": 1.5}, "diff_means": {"token": 0.5}},
]

SUMMARY = {  # the keys of summarize_rlvr the trackers read
    "groups_accepted": 4, "groups_rejected": {"zero_std": 3, "stale": 1}, "retention_rate": 0.5,
    "responses_per_accepted_response": 2.125,
    "difficulty": {"groups_generated": 8, "zero_variance_share": 0.375, "tokens_generated": 400,
                   "zero_variance_tokens": 120, "tokens_trained_on": 200, "share_of_tokens_trained_on": 0.5},
    "validation": {"groups": 4, "responses": 16, "by_policy_version": {
        "0": {"groups": 2, "responses": 8, "accuracy": 0.25, "reward_mean": 0.25, "pass@1": 0.25, "pass@4": 0.5},
        "2": {"groups": 2, "responses": 8, "accuracy": 0.5, "reward_mean": 0.625, "pass@1": 0.5, "pass@4": 1.0}}},
}

CONFIG = {"name": "tracked", "max_steps": 2, "actor_train": {"lr": 1e-06, "enabled": True},
          "rewards": {"gsm8k": {"query_filter_config": {"type": "std_filter"}}}, "datasets": [{"num_samples": 8}]}


class Recorder:
    """A tracker that keeps what it was given."""

    name = "recorder"

    def __init__(self) -> None:
        self.started: tuple | None = None
        self.points: dict[tuple[str, int], float] = {}
        self.calls: list[tuple[int, set[str]]] = []  # (step, names) of each log call
        self.closed = False

    def start(self, run_name, config) -> None:
        self.started = (run_name, config)

    def log(self, values, step) -> None:
        self.calls.append((step, set(values)))
        self.points.update({(k, step): v for k, v in values.items()})

    def close(self) -> None:
        self.closed = True


class Failing(Recorder):
    name = "failing"

    def log(self, values, step) -> None:
        raise ConnectionError("no network")


class Summaries:
    """A summary source returning the given summaries one call after another (the last again)."""

    def __init__(self, *summaries: dict) -> None:
        self.summaries = list(summaries)
        self.calls = 0
        self.closed = False

    def __call__(self) -> dict:
        self.calls += 1
        return self.summaries[min(self.calls, len(self.summaries)) - 1]

    def close(self) -> None:
        self.closed = True


def log_entries(trackers: Trackers, entries=ENTRIES) -> None:
    for entry in entries:
        trackers.log_step(entry["step"], step_metrics(entry, "trainer-test"))


# -- names and values -------------------------------------------------------------------------

def test_names_are_the_metrics_table_s_with_labels_as_path_parts_that_every_tracker_accepts():
    assert tracker_key("trainer/loss", {"step": "3"}) == "trainer/loss"
    assert tracker_key("trainer/pass_rate", {"step": "0", "check": "actor/train_infer_token_ratio_mask_mean@sum"}) \
        == "trainer/pass_rate/actor/train_infer_token_ratio_mask_mean_sum"  # MLflow refuses '@'
    assert tracker_key("validation/pass_at_k", {"k": "4", "policy_version": "2"}) == "validation/pass_at_k/4"
    with pytest.raises(KeyError, match="not in rollstream.observability.metrics.METRICS"):
        tracker_key("trainer/made_up")


def test_the_values_are_the_manifest_entry_s_and_the_summary_s():
    expected = expected_points(ENTRIES[:1], SUMMARY)
    logged = {(k, 1): v for k, v in trackers_module.step_values(step_metrics(ENTRIES[0], "w")).items()}
    logged.update({(k, 1): v for k, v in summary_values(SUMMARY).items()})
    logged.update({(k, v): x for v, row in validation_values(SUMMARY).items() for k, x in row.items()})
    assert_holds(logged, expected)
    assert set(logged) == set(expected)


def test_null_figures_and_an_agentic_summary_without_rounds_log_nothing_for_them():
    early = {"groups_accepted": 0, "groups_rejected": {}, "retention_rate": 0.0, "responses_per_accepted_response": None,
             "validation": {"groups": 0, "by_policy_version": {"0": {"accuracy": None, "reward_mean": None}}}}
    assert summary_values(early) == {"run/groups_accepted": 0.0, "run/retention_rate": 0.0}
    assert validation_values(early) == {}
    assert validation_values({"validation": {"groups": 2, "original": 2, "correct_mean": 0.5}}) == {}


def test_the_config_as_parameters_flattens_mappings_and_writes_leaves_as_json():
    assert flat_params(CONFIG) == {
        "name": "tracked", "max_steps": "2", "actor_train.lr": "1e-06", "actor_train.enabled": "true",
        "rewards.gsm8k.query_filter_config.type": "std_filter", "datasets": '[{"num_samples": 8}]'}
    assert len(flat_params({"long": "x" * 10_000})["long"]) == trackers_module.PARAM_MAX_CHARS


# -- the fan-out ------------------------------------------------------------------------------

def test_steps_then_the_summary_so_far_then_the_final_summary_reach_every_tracker_in_order():
    first, second = Recorder(), Recorder()
    source = Summaries({**SUMMARY, "retention_rate": 0.25})
    trackers = Trackers([first, second], source).start("tracked", CONFIG)
    log_entries(trackers)
    deadline = time.monotonic() + 10
    while source.calls == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    trackers.close(SUMMARY)
    assert source.calls >= 1 and source.closed
    for tracker in (first, second):
        assert tracker.started == ("tracked", CONFIG) and tracker.closed
        assert_holds(tracker.points, expected_points(ENTRIES, SUMMARY))  # the final summary's figures last
    # each validation round once: the final summary's rounds equal the ones read during the run
    assert [step for step, names in first.calls if "validation/accuracy" in names] == [0, 2]


def test_a_failing_tracker_warns_once_and_neither_training_nor_the_other_trackers_stop(caplog, monkeypatch):
    """Through the trainer's own hook: PolicyPublisher.publish_step after each commit."""
    from rollstream.trainer import publisher as publisher_module

    class Producer:
        def __init__(self) -> None:
            self.sent: list[str] = []

        def send(self, topic, key=None, value=None) -> None:
            self.sent.append(topic)

        def flush(self) -> None:
            pass

        def close(self) -> None:
            pass

    monkeypatch.setattr(publisher_module, "make_producer", lambda *args, **kwargs: Producer())
    from rollstream.kafka.topics import Topics

    publisher = publisher_module.PolicyPublisher("127.0.0.1:1", Topics("t."))
    healthy, failing = Recorder(), Failing()
    trackers = Trackers([failing, healthy]).start("tracked", CONFIG).install()
    assert process_trackers() is trackers
    with caplog.at_level(logging.WARNING, logger="rollstream.observability.trackers"):
        for entry in [*ENTRIES, {**ENTRIES[1], "step": 2, "policy_version": 3}]:
            entry = {**entry, "checkpoint": "/ckpt"}
            publisher.publish_step(entry)  # returns: the commit goes on
        trackers.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "tracker failing failed" in warnings[0] and "no network" in warnings[0]
    assert [step for step, _ in healthy.calls] == [1, 2, 3] and healthy.closed and failing.closed
    assert_holds(healthy.points, expected_points(ENTRIES, None))
    assert process_trackers() is not trackers and process_trackers().names == []  # uninstalled


def test_a_hung_tracker_holds_up_no_step_and_closing_gives_up_on_it_with_a_warning(caplog):
    release = threading.Event()

    class Hung(Recorder):
        name = "hung"
        finished = False

        def log(self, values, step) -> None:
            release.wait(30)
            self.finished = True

    hung, healthy = Hung(), Recorder()
    trackers = Trackers([hung, healthy]).start("tracked", CONFIG)
    log_entries(trackers)
    assert not hung.finished  # the steps were logged while the hung tracker still hangs
    with caplog.at_level(logging.WARNING, logger="rollstream.observability.trackers"):
        trackers.close(timeout_s=1.0)
    release.set()
    assert [step for step, _ in healthy.calls] == [1, 2] and healthy.closed
    assert any("['hung'] did not finish writing within 1 s" in r.getMessage() for r in caplog.records)


def test_a_failed_read_of_the_run_s_figures_warns_once_and_the_step_figures_go_on(caplog):
    class Broken(Summaries):
        def __call__(self) -> dict:
            self.calls += 1
            raise OSError("broker gone")

    recorder, source = Recorder(), Broken()
    trackers = Trackers([recorder], source)
    with caplog.at_level(logging.WARNING, logger="rollstream.observability.trackers"):
        log_entries(trackers)
        deadline = time.monotonic() + 10
        while not source.closed and time.monotonic() < deadline:
            time.sleep(0.01)
        log_entries(trackers, [{**ENTRIES[1], "step": 2}])
        trackers.close()
    assert source.calls == 1 and source.closed
    assert [r.getMessage() for r in caplog.records if "reading the run's figures" in r.getMessage()] != []
    assert len(caplog.records) == 1
    assert [step for step, _ in recorder.calls] == [1, 2, 3]


def test_without_trackers_nothing_runs():
    trackers = Trackers([], Summaries(SUMMARY))
    log_entries(trackers)
    trackers.close(SUMMARY)
    assert trackers.names == [] and process_trackers().names == []


def test_a_tracker_whose_package_is_missing_is_a_config_error_naming_the_key(monkeypatch):
    check_installed(["console", "tensorboard", "wandb", "mlflow"])  # all in requirements.lock
    monkeypatch.setattr(trackers_module.WandbTracker, "package", "rollstream_no_such_package")
    with pytest.raises(ConfigError) as info:
        Trackers.of(["console", "wandb"], "p", "/nonexistent")
    assert str(info.value) == ("trainer.loggers: wandb needs the rollstream_no_such_package package, which is not "
                               "installed: pip install 'rollstream[wandb]'")


# -- each backend, read back with its own reader ----------------------------------------------

def run_backend(name: str, log_dir) -> None:
    trackers = Trackers.of([name], "rollstream-test", log_dir, Summaries(SUMMARY)).start("tracked", CONFIG)
    log_entries(trackers)
    trackers.close(SUMMARY)


def test_tensorboard_event_files_hold_every_figure(tmp_path):
    run_backend("tensorboard", tmp_path)
    points, texts = tensorboard_points(tmp_path / "tensorboard")
    assert_holds(points, expected_points(ENTRIES, SUMMARY))
    assert texts["run_name"] == "tracked"
    assert "actor_train:" in texts["config"] and "lr: 1.0e-06" in texts["config"]


def test_an_offline_wandb_run_holds_every_figure(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_backend("wandb", tmp_path)
    records = wandb_records(tmp_path)
    assert_holds(wandb_points(records), expected_points(ENTRIES, SUMMARY))
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    assert (run["display_name"], run["project"]) == ("tracked", "rollstream-test")
    assert {k: v for k, v in run["config"]["update"].items() if not k.startswith("_")} == CONFIG
    # every chart's x axis is global_step
    assert {"glob_name": "*", "options": {"defined": True, "step_sync": True}, "step_metric": "global_step"} in [
        r["metric"] for r in records if r["type"] == "metric"]


@pytest.mark.parametrize("tracking_uri", [False, True])
def test_an_mlflow_file_store_holds_every_figure(tmp_path, monkeypatch, tracking_uri):
    """In the log folder's mlruns by default; at MLFLOW_TRACKING_URI when it is set."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # restored after the test: the tracker sets it
    if tracking_uri:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "elsewhere").as_uri())
    else:
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_backend("mlflow", tmp_path)
    assert (tmp_path / "mlruns").exists() != tracking_uri
    client, run = mlflow_run(tmp_path / ("elsewhere" if tracking_uri else "mlruns"), "rollstream-test")
    assert (run.info.run_name, run.info.status) == ("tracked", "FINISHED")
    assert run.data.params == flat_params(CONFIG)
    assert_holds(mlflow_points(client, run), expected_points(ENTRIES, SUMMARY))
