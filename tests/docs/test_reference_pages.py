"""The reference pages are generated from the code and never stale: every config field has a
description, docs/reference/config.md and cli.md are what `make reference` writes today, and a
short flag means one thing across every command."""

from __future__ import annotations

from pathlib import Path

from rollstream.app import cli_reference
from rollstream.config import reference

ROOT = Path(__file__).resolve().parents[2]


def test_every_config_field_has_a_description():
    assert reference.undescribed() == []


def test_the_config_reference_is_the_generated_page():
    page = (ROOT / "docs" / "reference" / "config.md").read_text()
    assert page == reference.render(), "docs/reference/config.md is stale: run `make reference`"


def test_the_page_names_every_key_of_both_pipelines():
    page = reference.render()
    for key in ("num_return_sequences_in_group", "max_prompts_per_batch", "history_filter", "screening",
                "train_env_manager", "group_filter_cls", "max_num_seqs", "mask_collapse_threshold"):
        assert f"| `{key}` |" in page, key
    # a bare <name> outside a code span is escaped, so the table shows it
    assert "runs/&lt;name>" in page


def test_the_cli_reference_is_the_generated_page():
    page = (ROOT / "docs" / "reference" / "cli.md").read_text()
    assert page == cli_reference.render(), "docs/reference/cli.md is stale: run `make reference`"


def test_a_short_flag_means_one_thing_in_every_command():
    flags = cli_reference.short_flags()
    assert {flag: names for flag, names in flags.items() if len(names) > 1} == {}
    assert flags["-f"] == {"--format"} and flags["-c"] == {"--config"} and flags["-b"] == {"--bootstrap"}


def test_the_cli_page_lists_every_command():
    page = cli_reference.render()
    for command in ("run", "worker", "produce-prompts", "replay", "whatif", "report", "stats", "export", "audit",
                    "broker start"):
        assert f"## rollstream {command}\n" in page, command
