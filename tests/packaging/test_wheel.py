"""The package as a user installs it: the wheel built from this checkout, installed into a new
virtual environment, runs a bundled example from a folder outside the checkout (the work is
tests/packaging/wheel_probe.py, run in the background while the other tests run)."""

from __future__ import annotations

import zipfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_installs_into_a_new_environment_and_runs_a_bundled_example(installed_wheel):
    w = installed_wheel
    assert w["wheel"] == "rollstream-0.1.0-py3-none-any.whl"
    assert "/venv/lib/" in w["imported_from"] and not w["imported_from"].startswith(str(ROOT))
    assert (w["version_code"], w["version"]) == (0, "rollstream 0.1.0")
    assert w["run_code"] == 0, w["run_tail"]
    summary = w["summary"]
    assert summary["outcome"] == "complete" and len(summary["batches"]) == 1
    assert summary["batches"][0]["groups"] == 1
    assert {"batches.jsonl", "config.yaml", "logs"} <= set(w["run_dir"])


def test_the_byo_example_runs_from_the_wheel_with_its_data_and_reward_module_beside_it(installed_wheel):
    w = installed_wheel
    assert w["byo_code"] == 0, w["byo_config"]
    config = yaml.safe_load(w["byo_config"])
    byo = config["base_dir"]
    assert "/venv/lib/" in byo and byo.endswith("rollstream/examples/byo")
    assert (config["datasets"][0]["source"], config["rewards"]["math"]["reward_type"]) == (
        f"{byo}/qa.jsonl", "byo_rewards:exact_match")


def test_the_wheel_holds_the_schemas_broker_files_examples_and_console_script(installed_wheel):
    wheel = Path(installed_wheel["folder"]) / "dist" / installed_wheel["wheel"]
    names = set(zipfile.ZipFile(wheel).namelist())
    schemas = {f"rollstream/schemas/{p.name}" for p in (ROOT / "rollstream" / "schemas").glob("*.avsc")}
    examples = {f"rollstream/examples/{p.relative_to(ROOT / 'examples')}" for p in (ROOT / "examples").rglob("*")
                if p.is_file()}
    assert schemas and schemas <= names
    assert examples and examples <= names
    assert {"rollstream/kafka/broker_files/pom.xml", "rollstream/kafka/broker_files/log4j.properties"} <= names
    entry_points = zipfile.ZipFile(wheel).read("rollstream-0.1.0.dist-info/entry_points.txt").decode()
    assert "rollstream = rollstream.app.cli:app" in entry_points
