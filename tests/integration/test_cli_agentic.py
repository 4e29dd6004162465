"""The agentic commands of the CLI against the real broker: `worker` refuses a stage of the other
pipeline (after the broker check, which passes here) and `start-groups` opens every env group."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from rollstream.app.cli import app
from rollstream.tools.readback import read_values

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def one_line(output: str) -> str:
    return " ".join(output.split())


def write_example(tmp_path: Path, example: str, prefix: str) -> Path:
    data = yaml.safe_load((ROOT / "examples" / example).read_text())
    data["kafka"]["topic_prefix"] = prefix
    path = tmp_path / example
    path.write_text(yaml.safe_dump(data))
    return path


def test_worker_refuses_a_stage_of_the_other_pipeline(kafka_broker, tmp_path):
    rlvr = write_example(tmp_path, "rlvr_math.yaml", "cli-never.")
    agentic = write_example(tmp_path, "agentic_frozenlake.yaml", "cli-never.")
    result = runner.invoke(app, ["worker", "env", "-c", str(rlvr), "-b", kafka_broker])
    assert result.exit_code == 2
    assert one_line(result.output) == (
        "error: stage 'env' is not part of the RLVR pipeline: "
        "['admission', 'aggregator', 'generation', 'reward', 'trainer']")
    result = runner.invoke(app, ["worker", "aggregator", "-c", str(agentic), "-b", kafka_broker])
    assert result.exit_code == 2
    assert one_line(result.output) == (
        "error: stage 'aggregator' is not part of the agentic pipeline: ['group-queue', 'env', 'trainer']")


def test_start_groups_opens_every_env_group_val_first(kafka_broker, topic_factory, tmp_path):
    topics = topic_factory(["episodes.control"], partitions=1)
    agentic = write_example(tmp_path, "agentic_frozenlake.yaml", topics.prefix)
    result = runner.invoke(app, ["start-groups", "-c", str(agentic), "-b", kafka_broker])
    assert result.exit_code == 0, result.output
    assert one_line(result.output) == "started 4 env groups"  # train 3 + val 1
    commands = [(c["command"], c["mode"], c["group_id"]) for c in read_values(kafka_broker, topics.episodes_control)]
    assert commands == [("start", "val", 0), ("start", "train", 0), ("start", "train", 1), ("start", "train", 2)]
