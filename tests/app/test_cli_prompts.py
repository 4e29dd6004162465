"""`rollstream produce-prompts --file`: a bad flag, file or row is one clear line and exit code 2,
before the broker is looked for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rollstream.app.cli import app

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "rlvr_math.yaml")  # rewards domains: arithmetic, gsm8k
runner = CliRunner()


def one_line(output: str) -> str:
    return " ".join(output.split())


@pytest.fixture
def qa(tmp_path) -> str:
    path = tmp_path / "qa.jsonl"
    path.write_text(json.dumps({"question": "2+3?", "answer": "5"}) + "\n" + json.dumps({"question": "7-4?"}) + "\n")
    return str(path)


@pytest.mark.parametrize("args, message", [
    (["--domain", "gsm8k", "--mode", "val"], "error: --domain, --mode apply to --file only"),
    (["--file", "{qa}", "--domain", "gsm8k", "--prompt-key", "question", "--ground-truth-key", "answer"],
     "error: {qa}:2: no key 'answer' (keys: ['question'])"),
    (["--file", "{qa}", "--domain", "gsm8k"],
     "error: {qa}: set exactly one of prompt_key (a text) and messages_key (chat messages)"),
    (["--file", "{qa}", "--domain", "algebra", "--prompt-key", "question"],
     "error: {qa}: domain 'algebra' has no rewards entry in {example}; known: ['arithmetic', 'gsm8k']"),
    (["--file", "{qa}", "--domain", "gsm8k", "--prompt-key", "question", "--mode", "test"],
     "error: mode: Input should be 'train' or 'val'"),
])
def test_produce_prompts_file_errors(qa, args, message):
    result = runner.invoke(app, ["produce-prompts", "-c", EXAMPLE, "-b", "127.0.0.1:1",
                                 *[a.format(qa=qa) for a in args]])
    assert (result.exit_code, one_line(result.output)) == (2, message.format(qa=qa, example=EXAMPLE))
