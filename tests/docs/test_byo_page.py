"""Every config of docs/byo.md ("Bring your own workload") and docs/inference.md (the servers'
config) loads: its model, data files and reward module exist here as the pages describe them (the
reward module is the byo page's own Python block), so a renamed key or a stale example fails this
test."""

from __future__ import annotations

import json
import re
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from rollstream.config import load_config, parse_config
from rollstream.policy.model import ensure_model_cache

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "docs" / "byo.md", ROOT / "docs" / "inference.md"]


def section() -> str:
    return "\n".join(page.read_text() for page in PAGES)


def blocks(language: str) -> list[str]:
    """The section's code blocks in ``language``, in order (list items' blocks dedented)."""
    return [textwrap.dedent(b) for b in re.findall(rf"```{language}\n(.*?)```", section(), re.DOTALL)]


@pytest.fixture
def user_files(tmp_path, monkeypatch):
    """The files the section's configs name, relative to the working directory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "qa.jsonl").write_text(
        "".join(json.dumps({"question": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n" for i in range(3)))
    pq.write_table(pa.Table.from_pylist([
        {"data_source": "math", "ability": "math", "extra_info": {"index": i},
         "prompt": [{"role": "system", "content": "Answer with a number."},
                    {"role": "user", "content": f"What is {i} * 2?"}],
         "reward_model": {"style": "rule", "ground_truth": str(2 * i)}} for i in range(3)]),
        tmp_path / "data" / "train.parquet")
    (tmp_path / "mypkg").mkdir()
    [reward_module] = [b for b in blocks("python") if b.startswith("# mypkg/rewards.py")]
    (tmp_path / "mypkg" / "rewards.py").write_text(reward_module)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m == "mypkg" or m.startswith("mypkg.")]:
        del sys.modules[name]


def test_the_section_has_a_config_per_item():
    names = [yaml.safe_load(b)["name"] for b in blocks("yaml")]
    assert names == ["my-model", "my-prompts", "my-epochs", "my-reward", "my-trainer", "my-servers"]


def test_every_config_of_the_section_loads(user_files):
    model = str(ensure_model_cache())  # stands for the user's model folder
    for block in blocks("yaml"):
        data = yaml.safe_load(block)
        if "pretrain" in data:
            data["pretrain"] = model
        config = parse_config(data)
        assert config.name == data["name"]
    my_model = parse_config({**yaml.safe_load(blocks("yaml")[0]), "pretrain": model})
    assert (my_model.infer_model_path, my_model.train_model_path) == (model, model)
    assert (my_model.actor_infer.dtype, my_model.actor_train.dtype) == ("bfloat16", "float32")


def test_the_reward_function_of_the_section_scores(user_files):
    from mypkg.rewards import exact_match  # the section's own code

    assert exact_match("so the answer is 42", "42", prompt_id="p") == {"score": 1.0, "acc": 1.0}
    assert exact_match("41", "42") == {"score": 0.0, "acc": 0.0}


def test_the_combined_example_loads_from_any_folder_by_its_bundled_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # its data and reward module resolve beside it, not in the working directory
    config = load_config("byo/rlvr_own")
    assert (config.num_epochs, config.adv_estimator, config.rewards["math"].reward_type) == (
        2, "rloo", "byo_rewards:exact_match")
    byo = (ROOT / "rollstream" / "examples" / "byo").resolve()
    assert (config.base_dir, config.datasets[0].source, config.datasets[0].prompt_key) == (
        str(byo), str(byo / "qa.jsonl"), "question")
