"""What the experiment trackers wrote, read back with each library's own reader (offline), and
what they should hold, spelled out from the manifest entries and the run summary themselves."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

Points = dict[tuple[str, int], float]
"""(name, global step) -> the value logged last there."""


def expected_points(entries: list[dict], summary: dict | None) -> Points:
    """Every figure the trackers must hold: each manifest entry's at its step + 1, the summary's
    run figures at the last step, each validation round's at its policy version."""
    out: Points = {}
    for entry in entries:
        x = entry["step"] + 1
        for key in ("fill_seconds", "accepted_groups", "loss", "reward_mean", "final_mask_mean", "grad_norm",
                    "pg_clipfrac", "policy_version", "policy_lag_max", "train_seconds"):
            if key in entry:
                out[(f"trainer/{key}", x)] = float(entry[key])
        if "mask_collapse" in entry:
            out[("trainer/mask_collapse", x)] = float(entry["mask_collapse"])
        for check, value in entry.get("pass_rates", {}).items():
            out[(f"trainer/pass_rate/{check.replace('@', '_')}", x)] = value
        for agg, value in entry.get("ratio_means", {}).items():
            out[(f"trainer/ratio_mean/{agg}", x)] = value
        for agg, value in entry.get("diff_means", {}).items():
            out[(f"trainer/diff_mean/{agg}", x)] = value
    if summary is None:
        return out
    last = max(entry["step"] for entry in entries) + 1
    out[("run/groups_accepted", last)] = summary["groups_accepted"]
    out[("run/retention_rate", last)] = summary["retention_rate"]
    if summary["responses_per_accepted_response"] is not None:
        out[("run/responses_per_accepted_response", last)] = summary["responses_per_accepted_response"]
    for key, value in (summary.get("difficulty") or {}).items():
        if key in ("zero_variance_share", "share_of_tokens_trained_on") and value is not None:
            out[(f"run/{key}", last)] = value
    for reason, n in summary["groups_rejected"].items():
        out[(f"run/groups_rejected/{reason}", last)] = n
    for version, row in summary["validation"].get("by_policy_version", {}).items():
        out[("validation/accuracy", int(version))] = row["accuracy"]
        out[("validation/reward_mean", int(version))] = row["reward_mean"]
        for k in ("pass@1", f"pass@{row['responses'] // row['groups']}"):
            out[(f"validation/pass_at_k/{k[5:]}", int(version))] = row[k]
    return out


def assert_holds(logged: Points, expected: Points) -> None:
    """Every expected figure was logged, equal to float32 precision (TensorBoard's)."""
    missing = sorted(set(expected) - set(logged))
    assert missing == [], f"not logged: {missing}; logged: {sorted(logged)}"
    assert {k: logged[k] for k in expected} == {k: pytest.approx(v, rel=1e-6) for k, v in expected.items()}


def tensorboard_points(log_dir: Path) -> tuple[Points, dict[str, str]]:
    """The scalars of the event files under ``log_dir`` (TensorBoard's EventAccumulator, nothing
    sampled away) and its text summaries by tag."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    points = {(tag, e.step): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}
    texts = {tag.removesuffix("/text_summary"): acc.Tensors(tag)[-1].tensor_proto.string_val[0].decode()
             for tag in acc.Tags()["tensors"]}
    return points, texts


def wandb_records(log_dir: Path) -> list[dict]:
    """The records of the one offline wandb run under ``log_dir``, from wandb's own reader of its
    transaction log (``wandb leet inspect --json``, one JSON record per line)."""
    (path,) = (log_dir / "wandb").glob("offline-run-*/run-*.wandb")
    out = subprocess.run([str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--json", str(path)],
                         capture_output=True, text=True, timeout=120, check=True)
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def wandb_points(records: list[dict]) -> Points:
    """History rows as points: each row's values at its ``global_step``."""
    out: Points = {}
    for record in records:
        if record["type"] == "history":
            row = record["history"]["item"]
            out.update({(k, int(row["global_step"])): v for k, v in row.items()
                        if not k.startswith("_") and k != "global_step"})
    return out


def mlflow_run(store: Path, experiment: str):
    """(client, the one run of ``experiment``) of the MLflow file store at ``store``."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=store.absolute().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return client, run


def mlflow_points(client, run) -> Points:
    """Every metric's history (in the order logged) as points."""
    out: Points = {}
    for key in run.data.metrics:
        out.update({(key, m.step): m.value for m in client.get_metric_history(run.info.run_id, key)})
    return out
