"""A command whose options arrive as one record: typer sees the record's fields as its options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pytest
import typer
from typer.testing import CliRunner

from rollstream.app.options import command_options


@dataclass(frozen=True)
class Options:
    name: str = typer.Argument(..., help="Who.")
    times: int = typer.Option(1, "--times", "-n", min=1, help="How often.")
    loud: bool = typer.Option(False, "--loud/--quiet")
    tag: list[str] = typer.Option([], "--tag")
    note: Optional[str] = typer.Option(None, "--note")


app = typer.Typer()


@app.command()
@command_options(Options)
def greet(o: Options) -> None:
    """Greet."""
    typer.echo(f"{o!r}")


def test_the_fields_become_the_options_and_the_command_gets_the_record():
    result = CliRunner().invoke(app, ["ada", "-n", "2", "--loud", "--tag", "a", "--tag", "b"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == repr(Options("ada", 2, True, ["a", "b"], None))
    assert greet.__doc__ == "Greet."


def test_the_fields_defaults_and_checks_hold():
    assert CliRunner().invoke(app, ["ada"]).output.strip() == repr(Options("ada", 1, False, [], None))
    bad = CliRunner().invoke(app, ["ada", "--times", "0"])
    assert bad.exit_code == 2 and "--times" in bad.output  # the option's own range check


def test_a_record_that_is_not_a_dataclass_is_refused():
    with pytest.raises(TypeError, match="not a dataclass"):
        command_options(dict)
