"""The environment `make env` builds holds compiled bytecode for what the processes import.
Python writes its .pyc cache only where it may: under PYTHONDONTWRITEBYTECODE=1 (set on some CI
machines) an environment without one compiles torch and transformers again in every process,
~10 CPU-s of each stage's start-up (measured: the demo's first token after 23 s instead of 11)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

# What a stage process imports (the heavy libraries and rollstream's own entry points).
MODULES = ["torch", "transformers", "faust.app.base", "kafka.consumer.group", "fastavro", "rollstream.app.cli", "rollstream.app.run",
           "rollstream.workers.generation", "rollstream.trainer.driver"]


@pytest.mark.parametrize("name", MODULES)
def test_every_imported_module_has_its_bytecode_cached(name):
    origin = importlib.util.find_spec(name).origin
    assert Path(importlib.util.cache_from_source(origin)).is_file(), (
        f"{name} has no compiled bytecode beside {origin}: run `make env` (UV_COMPILE_BYTECODE=1 and compileall)")
