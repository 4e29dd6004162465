"""docs/extending.md: every extension kind is on the page, and each example works as the page says,
run from the page's own code: its Python blocks are written as ``my_extensions.py`` and each object
goes through the path a run takes (the registry, the config, the stage's loader)."""

from __future__ import annotations

import json
import math
import re
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from rollstream import extensions
from rollstream.config import EnvManagerConfig, parse_config
from rollstream.config.base import ActorInferConfig
from rollstream.config.reward_functions import load_reward_function
from rollstream.data import load_prompts
from rollstream.extensions import QUERY_FILTERS, RESPONSE_FILTERS
from rollstream.filtering.group_filters import filter_group, load_group_filter
from rollstream.filtering.query_filters import float32_tensor
from rollstream.filtering.registry import resolve_filter
from rollstream.inference.backends import load_backend
from rollstream.inference.engine import SamplingParams
from rollstream.observability.trackers import make_tracker
from rollstream.policy.model import load_tokenizer
from rollstream.trainer.batch import resolve_estimator
from rollstream.workers.envs import make_env

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "extending.md"
M = "my_extensions"


def blocks(language: str) -> list[str]:
    return [textwrap.dedent(b) for b in re.findall(rf"```{language}\n(.*?)```", PAGE.read_text(), re.DOTALL)]


@pytest.fixture
def module(tmp_path, monkeypatch):
    """The page's Python blocks as my_extensions.py, importable from the working directory."""
    (tmp_path / f"{M}.py").write_text("\n\n".join(blocks("python")))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop(M, None)


def test_the_page_lists_every_kind_and_every_built_in():
    text = PAGE.read_text()
    for registry in extensions.ALL:
        assert registry.kind.split(".")[-1].removesuffix("[].source") in text, registry.kind
        for name in registry.names():
            assert f"`{name}" in text, (registry.kind, name)


def test_filters_reward_source_and_estimator_work_as_the_page_says(module):
    keep = resolve_filter(QUERY_FILTERS, f"{M}:min_spread")
    assert keep(float32_tensor([0.0, 1.0]), {"spread": 1.0}).keep
    assert keep(float32_tensor([1.0, 1.0]), {"spread": 1.0}).reason == "custom_query_filter"
    short = resolve_filter(RESPONSE_FILTERS, f"{M}:at_most_tokens")
    assert short({"response": {"response_length": 32}}, {"max_tokens": 32}).keep
    assert short({"response": {"response_length": 33}}, {"max_tokens": 32}).reason == "custom_response_filter"
    reward = load_reward_function(f"{M}:exact_match")
    assert (reward(" 12\n", "12"), reward("13", "12")) == (1.0, 0.0)
    prompts = load_prompts(f"{M}:sums", "sums", 3, seed=1, config={"high": 20})
    assert [p["prompt_id"] for p in prompts] == ["sums-00000", "sums-00001", "sums-00002"]
    assert all(p["domain"] == "sums" and p["mode"] == "train" and p["created_ms"] == 0 for p in prompts)
    a, b = map(int, re.findall(r"\d+", prompts[0]["prompt"])[:2])
    assert prompts[0]["ground_truth"] == str(a + b) and 1 <= a <= 20 and 1 <= b <= 20
    estimator = resolve_estimator(f"{M}:range_normalised")
    rewards = torch.tensor([[0.0, 2.0, 4.0]])
    advantages = estimator(rewards - rewards.mean(dim=1, keepdim=True), rewards, 1e-6)
    assert torch.allclose(advantages, torch.tensor([[-0.5, 0.0, 0.5]]), atol=1e-6)


def test_group_filter_and_environment_work_as_the_page_says(module):
    manager = EnvManagerConfig(num_env_groups=1, group_size=2, tags=["Guess"])
    drop = load_group_filter(f"{M}:AllFailed", None, manager, "train")
    assert filter_group(drop, 0, 0, [{"success": False}, None])[0] is True
    assert filter_group(drop, 0, 1, [{"success": True}, {"success": False}])[0] is False
    assert filter_group(load_group_filter(f"{M}:AllFailed", None, manager, "val"), 0, 0, [{"success": False}])[0] is False
    env = make_env(f"{M}:GuessNumber", {"high": 8})
    assert env.reset(seed=3).startswith("Guess my number between 1 and 8")
    low, high = 1, 8
    for _ in range(4):  # bisection finds it in at most log2(8) + 1 guesses
        guess = (low + high) // 2
        result = env.step(f"My guess: {guess}")
        if result.done:
            break
        low, high = (guess + 1, high) if result.observation == "Higher." else (low, guess - 1)
    assert (result.done, result.success, result.reward) == (True, True, 1.0)
    assert env.step("no idea").invalid_move


def test_tracker_and_backend_work_as_the_page_says(module):
    tracker = make_tracker(f"{M}:JsonlTracker", "proj", module / "logs")
    tracker.start("run-1", {})
    tracker.log({"loss": 0.5}, step=3)
    tracker.close()
    assert [json.loads(line) for line in (module / "logs" / "metrics.jsonl").read_text().splitlines()] == [
        {"step": 3, "loss": 0.5}]
    backend = load_backend(ActorInferConfig(backend=f"{M}:GreedyTransformers", dtype="float32"), None)
    ids = load_tokenizer(None)("What is 2 + 2?")["input_ids"]
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=6)
    first, second = (backend.generate([ids], [2], [replace_seed(params, s)]) for s in (1, 2))
    assert [s.token_ids for s in first[0]] == [s.token_ids for s in second[0]]  # greedy: seeds do not matter
    assert all(len(s.token_ids) > 0 and all(math.isfinite(x) for x in s.logprobs) for s in first[0])


def replace_seed(params: SamplingParams, seed: int) -> SamplingParams:
    from dataclasses import replace

    return replace(params, seed=seed)


def test_the_pages_configs_load(module):
    rlvr_fragment, agentic_fragment = (yaml.safe_load(b) for b in blocks("yaml"))
    rlvr = {**yaml.safe_load((ROOT / "examples" / "rlvr_math.yaml").read_text()), **rlvr_fragment}
    cfg = parse_config(rlvr)
    assert (cfg.rewards["sums"].query_filter_config.type, cfg.actor_infer.backend, cfg.trainer.loggers[1]) == (
        f"{M}:min_spread", f"{M}:GreedyTransformers", f"{M}:JsonlTracker")
    agentic = yaml.safe_load((ROOT / "examples" / "agentic_frozenlake.yaml").read_text())
    for key, value in agentic_fragment.items():
        agentic[key] = {**agentic[key], **value} if key.endswith("env_manager") else value
    cfg = parse_config(agentic)
    assert (cfg.custom_envs["Guess"].env_type, cfg.train_env_manager.group_filter_cls) == (
        f"{M}:GuessNumber", f"{M}:AllFailed")
