"""docs/reference/cli.md, generated from the command-line app: every command, its arguments and
flags with their help. ``python -m rollstream.app.cli_reference > docs/reference/cli.md``
(``make reference``) writes it; a test fails when it is stale or one short flag means two things."""

from __future__ import annotations

import sys
from typing import Any, Iterator

import typer.main

from rollstream.app.cli import app

HEADER = """# Command-line reference

Every `rollstream` command and flag, generated from the commands themselves by `make reference`
(a test fails when this page is stale). A short flag means the same everywhere: `-c` the config
file, `-b` the bootstrap servers, `-o` an output file, `-w` a filter, `-p` a partition, `-f` an
output format. Commands that read a config print the resolved one with `--print-config`.

**Exit codes.** 0: done (for `run`, outcome `complete` or `end_of_data`). 1: a check failed
(`audit`, or `broker status` when no broker runs). 2:
bad input, named in one `error:` line: the config or an override, a flag, a path, an unreachable
or refusing broker, and for `run` a configuration error a stage found once running (outcome
`config_error`, e.g. a reward function that does not return its query filter's metric). 3: `run`
ended otherwise (`batch_underfilled`, `timed_out`, `stage_failed`, `disk_full`, `stopped`; the summary's
`detail` says why). 78: `worker`, a configuration error its stage found once running (sysexits'
EX_CONFIG; `run` does not restart it). 130, 143, 129: stopped by Ctrl-C, SIGTERM or SIGHUP, its
stages and broker stopped with it.
"""


def commands() -> Iterator[tuple[str, Any]]:
    """(``rollstream <name>``, its click command) for every command, groups walked, by name."""
    def walk(command: Any, prefix: str) -> Iterator[tuple[str, Any]]:
        if hasattr(command, "commands"):
            for name in sorted(command.commands):
                yield from walk(command.commands[name], f"{prefix} {name}")
        else:
            yield prefix, command

    yield from walk(typer.main.get_command(app), "rollstream")


def short_flags() -> dict[str, set[str]]:
    """Each short flag (``-c``) and the long names it stands for across every command."""
    meaning: dict[str, set[str]] = {}
    for _, command in commands():
        for param in command.params:
            names = param.opts + param.secondary_opts
            long = next((n for n in names if n.startswith("--")), param.name)
            for name in names:
                if name.startswith("-") and not name.startswith("--"):
                    meaning.setdefault(name, set()).add(long)
    return meaning


def cell(text: str | None) -> str:
    return " ".join((text or "").split()).replace("|", "\\|").replace("<", "&lt;")


def render() -> str:
    """The page, as markdown."""
    out = [HEADER]
    for name, command in commands():
        out += ["", f"## {name}", "", cell(command.help).split(". ")[0].rstrip(".") + ".", "",
                "| argument or flag | default | help |", "|---|---|---|"]
        for param in command.params:
            if param.param_type_name == "argument":
                flag = f"`{param.name.upper()}`"
            else:
                flag = ", ".join(f"`{n}`" for n in param.opts + param.secondary_opts)
            default = param.default
            shown = "required" if param.required else "" if default in (None, False, ()) else f"`{default}`"
            out.append(f"| {flag} | {shown} | {cell(getattr(param, 'help', None))} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
