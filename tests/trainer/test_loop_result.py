"""A trainer's result holds constant memory however long it runs (it once kept every manifest
entry: several kB per step, about 15 MB an hour in the soak)."""

from __future__ import annotations

import tracemalloc

from rollstream.trainer.loop import LoopResult


def entry(step: int) -> dict:
    return {"step": step, "status": "complete", "accepted_groups": 4,
            "group_keys": [f"prompt-{step}-{i}" for i in range(4)], "offsets": {"0": step, "1": step},
            "arrived_ms": [step] * 4, "loss": 0.5}


def test_a_result_counts_the_committed_batches_and_keeps_the_last():
    result = LoopResult()
    assert (result.steps, result.groups, result.last) == (0, 0, None)
    result.add(entry(0))
    result.add({**entry(1), "accepted_groups": 2})
    assert (result.steps, result.groups, result.last["step"]) == (2, 6, 1)


def test_a_result_holds_constant_memory_per_step():
    result = LoopResult()
    tracemalloc.start()
    try:
        for step in range(100):
            result.add(entry(step))
        before = tracemalloc.get_traced_memory()[0]
        for step in range(100, 10_100):
            result.add(entry(step))
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert result.steps == 10_100
    assert grown < 4096, grown  # one entry's worth at most; a list of them would be ~30 MB
