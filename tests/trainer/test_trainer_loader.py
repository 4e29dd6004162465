"""The trainer's model loads on a thread once the pipeline has started generating: until then
nothing is loaded, a run that ends first loads nothing, and the resume state comes from the
checkpoint folder without the model."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from rollstream.config import load_config
from rollstream.trainer.driver import TrainerLoader

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rlvr_math.yaml"


def test_a_run_that_ends_before_generation_started_loads_no_model(tmp_path):
    asked = threading.Event()

    def ready() -> bool:
        asked.set()
        return False

    loader = TrainerLoader(load_config(EXAMPLE), tmp_path / "checkpoints", ready)
    assert asked.wait(30) and loader.resume is None
    loader.close()  # never ready: nothing was loaded
    assert loader.trainer() is None


def test_the_resume_state_is_read_from_the_newest_checkpoint_without_the_model(tmp_path):
    state = {"step": 2, "group_keys": ["a", "b"], "report": {"loss": 0.5}, "version": 3}
    for version, step in ((2, 1), (3, 2)):
        folder = tmp_path / "checkpoints" / f"v{version:06d}"
        folder.mkdir(parents=True)
        (folder / "trainer_state.json").write_text(json.dumps({**state, "step": step, "version": version}))
    loader = TrainerLoader(load_config(EXAMPLE), tmp_path / "checkpoints", lambda: False)
    try:
        assert loader.resume == {**state, "checkpoint": str(tmp_path / "checkpoints" / "v000003")}
    finally:
        loader.close()


def test_without_training_there_is_no_model_and_no_resume(tmp_path):
    loader = TrainerLoader(load_config(EXAMPLE, ["actor_train.enabled=false"]), tmp_path, lambda: True)
    assert loader.resume is None and loader.trainer() is None
    loader.close()
