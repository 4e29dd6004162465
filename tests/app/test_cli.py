"""CLI errors are one clear line and exit code 2, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from rollstream.app.cli import app
from rollstream.app.stages import Stage, run_stage
from rollstream.config import load_config
from rollstream.exceptions import ConfigError

ROOT = Path(__file__).resolve().parents[2]
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


@pytest.mark.parametrize("samples, message", [
    (4, "rewards.gsm8k.screening.samples: 4 must be below num_return_sequences_in_group (4)"),
    (0, "rewards.gsm8k.screening.samples: must be >= 2"),
])
def test_absurd_screening_is_one_line_and_exit_2(tmp_path, samples, message):
    bad = tmp_path / "bad.yaml"
    bad.write_text(Path(EXAMPLE).read_text().replace(
        "    query_filter_config:\n      type: std_filter",
        f"    screening: {{samples: {samples}}}\n    query_filter_config:\n      type: std_filter"))
    result = runner.invoke(app, ["run", str(bad)])
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("form", [["-c"], ["--config"], []])
def test_run_takes_its_config_with_c_like_every_command_or_as_the_positional_path(tmp_path, form):
    bad = tmp_path / "bad.yaml"
    bad.write_text(Path(EXAMPLE).read_text().replace("type: std_filter", "type: median_filter"))
    result = runner.invoke(app, ["run", *form, str(bad)])
    assert result.exit_code == 2
    assert "rewards.gsm8k" in result.output and "median_filter" in result.output


def test_run_without_a_config_or_with_two_is_a_clear_error(tmp_path):
    none = runner.invoke(app, ["run"])
    assert none.exit_code == 2 and "no config given: `rollstream run -c" in none.output
    two = runner.invoke(app, ["run", EXAMPLE, "-c", str(tmp_path / "other.yaml")])
    assert two.exit_code == 2 and "two configs given" in two.output


def test_every_command_that_reads_a_config_takes_it_as_c_config():
    import typer

    found = {}
    for path, cmd in _commands(typer.main.get_command(app), []):
        found[path] = [p.opts for p in cmd.params if p.name.startswith("config")]
    with_config = {path: opts for path, opts in found.items() if opts}
    assert {"run", "replay", "whatif", "stats", "report", "worker", "create-topics"} <= set(with_config)
    assert [path for path, opts in with_config.items() if ["--config", "-c"] not in opts] == []


def test_broker_status_exit_code_when_none_runs(tmp_path):
    result = runner.invoke(app, ["broker", "status", "--data-dir", str(tmp_path)])
    assert result.exit_code == 1 and "no broker running" in result.output


# -- the agentic pipeline's commands ------------------------------------------------------------

AGENTIC = str(ROOT / "examples" / "agentic_frozenlake.yaml")


def one_line(output: str) -> str:
    """The error as one line: rich wraps long lines at the console width."""
    return " ".join(output.split())


def test_start_groups_needs_an_agentic_config():
    result = runner.invoke(app, ["start-groups", "-c", EXAMPLE, "-b", "127.0.0.1:1"])
    assert result.exit_code == 2
    # refused before the broker is looked for: no "no Kafka broker answers" here
    assert one_line(result.output) == (
        f"error: {EXAMPLE} is an RLVR config; start-groups needs an agentic one (train_env_manager)")


def test_produce_prompts_refuses_an_agentic_config():
    result = runner.invoke(app, ["produce-prompts", "-c", AGENTIC, "-b", "127.0.0.1:1"])
    assert result.exit_code == 2
    assert one_line(result.output) == f"error: {AGENTIC} is an agentic config: it has no prompts; use start-groups"


RLVR_PIPELINE = "['admission', 'aggregator', 'generation', 'reward', 'trainer']"
AGENTIC_PIPELINE = "['group-queue', 'env', 'trainer']"


@pytest.mark.parametrize("config, stage, expected", [
    (EXAMPLE, Stage.env, f"stage 'env' is not part of the RLVR pipeline: {RLVR_PIPELINE}"),
    (EXAMPLE, Stage.group_queue, f"stage 'group-queue' is not part of the RLVR pipeline: {RLVR_PIPELINE}"),
    (AGENTIC, Stage.aggregator, f"stage 'aggregator' is not part of the agentic pipeline: {AGENTIC_PIPELINE}"),
    (AGENTIC, Stage.admission, f"stage 'admission' is not part of the agentic pipeline: {AGENTIC_PIPELINE}"),
    (AGENTIC, Stage.generation, f"stage 'generation' is not part of the agentic pipeline: {AGENTIC_PIPELINE}"),
    (AGENTIC, Stage.reward, f"stage 'reward' is not part of the agentic pipeline: {AGENTIC_PIPELINE}"),
])
def test_stage_of_the_other_pipeline_is_a_config_error_before_kafka(config, stage, expected):
    # `worker <stage>` checks the broker first (see tests/integration/test_cli_agentic.py for the
    # whole command); run_stage itself refuses before it touches Kafka: nothing listens on port 1
    with pytest.raises(ConfigError) as info:
        run_stage(stage, load_config(config), "127.0.0.1:1")
    assert str(info.value) == expected


@pytest.mark.parametrize("args", [
    ["replay", "groups.rejected", "-b", "127.0.0.1:1", "-w", "bogus"],
    ["replay", "groups.rejected", "-b", "127.0.0.1:1", "--payloads", "-w", "bogus"],
    ["worker", "nonsense", "-c", EXAMPLE, "-b", "127.0.0.1:1"],
])
def test_an_error_is_one_line_even_when_longer_than_the_terminal(args):
    result = runner.invoke(app, args, terminal_width=60)
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and len(lines[0]) > 60


def _commands(cmd, path):
    """(command path, command) of every leaf command (typer vendors its own click: duck-typed)."""
    if hasattr(cmd, "commands"):
        for name, sub in cmd.commands.items():
            yield from _commands(sub, [*path, name])
    else:
        yield " ".join(path), cmd


def test_every_option_of_every_command_has_help_text():
    """`-b/--bootstrap` had none in stats, report, replay and whatif (found by a fresh-eyes run)."""
    import typer

    found = list(_commands(typer.main.get_command(app), []))
    assert len(found) >= 12 and {"replay", "stats", "report", "whatif", "worker"} <= {p for p, _ in found}
    missing = [(path, p.opts) for path, cmd in found for p in cmd.params if p.param_type_name == "option" and not p.help]
    assert missing == []


AGENTIC_EXAMPLE = str(ROOT / "examples" / "agentic_frozenlake.yaml")
NO_BROKER = ["-b", "127.0.0.1:1"]


@pytest.mark.parametrize("argv", [
    ["run", EXAMPLE], ["run", "-c", EXAMPLE], ["worker", "aggregator", "-c", EXAMPLE, *NO_BROKER],
    ["create-topics", "-c", EXAMPLE, *NO_BROKER], ["produce-prompts", "-c", EXAMPLE, *NO_BROKER],
    ["whatif", "-c", EXAMPLE, *NO_BROKER], ["report", "-c", EXAMPLE, *NO_BROKER],
    ["audit", "-c", EXAMPLE, *NO_BROKER], ["start-groups", "-c", AGENTIC_EXAMPLE, *NO_BROKER],
])
def test_every_config_command_takes_overrides_and_prints_the_resolved_config(argv):
    import yaml

    overrides = ["max_steps=9", "kafka.partitions=3"]
    result = runner.invoke(app, [*argv, *overrides, "--print-config"])
    assert result.exit_code == 0, result.output
    expected = load_config(argv[argv.index("-c") + 1] if "-c" in argv else argv[1], overrides)
    assert yaml.safe_load(result.stdout) == expected.model_dump(mode="json")
    assert (expected.max_steps, expected.kafka.partitions) == (9, 3)


def test_a_bad_override_is_one_line_with_exit_code_2_and_nothing_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for bad, named in (("max_steps=abc", "override max_steps=abc: max_steps:"),
                       ("actor_train.nope=1", "override actor_train.nope=1: actor_train.nope:")):
        result = runner.invoke(app, ["run", EXAMPLE, bad])
        assert result.exit_code == 2 and named in result.output
        assert len(result.output.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []  # no run folder, no broker data


@pytest.mark.parametrize("argv", [["replay", "groups.accepted", *NO_BROKER], ["stats", *NO_BROKER]])
def test_overrides_without_a_config_are_refused(argv):
    result = runner.invoke(app, [*argv, "kafka.sasl_mechanism=PLAIN"])
    assert result.exit_code == 2 and "given without a config (-c)" in result.output


def test_an_unknown_or_missing_tracker_is_one_line_with_exit_code_2_and_nothing_started(tmp_path, monkeypatch):
    from rollstream.observability import trackers

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(trackers.MlflowTracker, "package", "rollstream_no_such_package")
    missing = ("trainer.loggers: mlflow needs the rollstream_no_such_package package, which is not installed: "
               "pip install 'rollstream[mlflow]'")
    for override, expected in (
            ("trainer.loggers=[nope]", "override trainer.loggers=[nope]: trainer.loggers.0: unknown trainer.loggers "
                                       "'nope'; valid: ['console', 'mlflow', 'tensorboard', 'wandb'] or an import "
                                       "path 'pkg.module:name'"),
            ("trainer.loggers=[tensorboard, mlflow]", missing)):
        result = runner.invoke(app, ["run", EXAMPLE, override])
        assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1
        assert one_line(result.output) == f"error: {expected}"
    assert list(tmp_path.iterdir()) == []  # no run folder, no broker data, no tracker files
    # `worker trainer` refuses before it touches Kafka (nothing listens on port 1)
    with pytest.raises(ConfigError) as info:
        run_stage(Stage.trainer, load_config(EXAMPLE, ["trainer.loggers=[mlflow]"]), "127.0.0.1:1")
    assert str(info.value) == missing
