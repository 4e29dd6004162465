"""CLI errors are one clear line and exit code 2, never a traceback."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from rollstream.cli import app

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "rlvr_math.yaml")
runner = CliRunner()


def test_unreachable_broker_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("ROLLSTREAM_BROKER_WAIT_S", "1")
    result = runner.invoke(app, ["create-topics", "-c", EXAMPLE, "-b", "127.0.0.1:1"])
    assert result.exit_code == 2
    assert "no Kafka broker answers at '127.0.0.1:1'" in result.output


def test_unknown_stage_lists_the_valid_ones():
    result = runner.invoke(app, ["worker", "bogus", "-c", EXAMPLE, "-b", "127.0.0.1:1"])
    assert result.exit_code == 2
    assert "unknown stage 'bogus'" in result.output and "aggregator" in result.output


def test_config_errors_name_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(Path(EXAMPLE).read_text().replace("type: std_filter", "type: median_filter"))
    result = runner.invoke(app, ["run", str(bad)])
    assert result.exit_code == 2
    assert "rewards.gsm8k" in result.output and "median_filter" in result.output
    missing = runner.invoke(app, ["run", str(tmp_path / "nope.yaml")])
    assert missing.exit_code == 2 and "config file not found" in missing.output


def test_broker_status_exit_code_when_none_runs(tmp_path):
    result = runner.invoke(app, ["broker", "status", "--data-dir", str(tmp_path)])
    assert result.exit_code == 1 and "no broker running" in result.output
