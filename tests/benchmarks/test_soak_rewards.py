"""The soak's reward functions against the prompts the soak really sends."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from soak import prompt_pool  # noqa: E402
from soak_rewards import last_number  # noqa: E402


def test_last_number_reads_the_answer_of_a_reasoning_gym_ground_truth():
    """The model soak's reward once compared replies with the whole task entry (JSON): every
    group scored 0, was rejected mean_too_low, and the trainer ended batch_underfilled at once."""
    prompt = prompt_pool()[0]  # "Calculate 5 - 3. ...", its answer 2
    assert prompt["prompt"].startswith("Calculate 5 - 3.")
    assert last_number("5 - 3 = 2", prompt["ground_truth"]) == 1.0
    assert last_number("The answer is 3", prompt["ground_truth"]) == 0.0
    assert last_number("no number", prompt["ground_truth"]) == 0.0
    assert last_number("so 12", "12") == 1.0
