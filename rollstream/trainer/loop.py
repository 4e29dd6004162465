"""Which batch is next, and when a run ends (rank 0; the consuming side).

``BatchLoop.batches()`` yields the batches of a run until the builder's step reaches ``max_steps``
(batches committed in total, a restarted trainer's earlier ones included) or the loop must end;
the caller trains each batch and commits it (``BatchBuilder.commit``) before asking for the next.
rollstream.trainer.rollout_stream.RolloutStream drives it for ``rollstream run``, ``rollstream
worker trainer`` and a user's own loop alike, and commits and publishes each batch itself.

Verdicts (rollstream.trainer.verdicts) end a step short of a full batch; ``verdict_action``
applies the configured ``min_fill_ratio``:

* underfilled, ``accepted / target >= min_fill_ratio`` -> the accepted groups ship as a partial
  batch;
* underfilled, otherwise -> the run stops with outcome ``batch_underfilled``; the accepted groups
  stay uncommitted in ``groups.accepted`` (never lost) for a later run;
* ``end_of_data`` (every prompt of the last epoch decided): the full batches before its step are
  built, then the same ratio decides whether the accepted rest ships as a final partial batch
  (manifest entry ``"end_of_data": true``); either way the run ends at once with outcome
  ``end_of_data``, never by a timeout.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator

from rollstream.trainer.batch import RolloutBatch
from rollstream.trainer.batch_builder import BatchBuilder
from rollstream.trainer.verdicts import AgenticBatchEvents, BatchEvents, verdict_action

POLL_S = 1.0
"""How long ``batches`` waits for a full batch before it reads the verdicts and the stop checks."""

CATCH_UP_S = 30.0
"""How long it waits for groups a verdict says precede it on the topics."""


@dataclass
class LoopResult:
    """How a trainer run ended, and what it committed: counts and the last manifest entry.

    Every entry is in the run's manifest (``batches.jsonl``, read by
    ``rollstream.trainer.manifest.Manifest``); the result keeps a constant amount of them, so a
    trainer that runs for days holds no per-step state.
    """

    outcome: str = "complete"  # complete | batch_underfilled | end_of_data | timed_out | stopped
    detail: str = ""
    steps: int = 0  # batches committed by this run
    groups: int = 0  # accepted groups in them
    last: dict | None = None  # the last committed manifest entry

    def add(self, entry: dict) -> None:
        """Count one committed batch's manifest ``entry``; it becomes ``last``."""
        self.steps += 1
        self.groups += int(entry.get("accepted_groups", 0))
        self.last = entry


def _no_check() -> None:
    return None


def _never() -> bool:
    return False


def _no_progress(result: "LoopResult", buffered: int) -> None:
    return None


@dataclass(frozen=True)
class LoopControl:
    """How a batch loop is watched and ended from outside.

    Attributes:
        deadline: ``time.monotonic()`` value after which it ends ``timed_out``; None: none.
        check: called before each poll; raises when a stage died.
        should_stop: polled before each batch; True ends the loop ``stopped``.
        on_progress: ``(result, buffered_groups)`` after every poll, and before a batch is
            yielded with its groups counted (they stay buffered until it is committed).
    """

    deadline: float | None = None
    check: Callable[[], None] = _no_check
    should_stop: Callable[[], bool] = _never
    on_progress: Callable[["LoopResult", int], None] = _no_progress


class BatchLoop:
    """The batches of one run from ``builder``, ended by ``events``' verdicts (module doc).

    Args:
        builder: the run's BatchBuilder (its ``step`` counts committed batches).
        events: the verdict reader (``BatchEvents``, or ``AgenticBatchEvents``).
        max_steps: batches in total, then the loop ends ``complete``.
        min_fill_ratio: the pipeline's; see ``verdict_action``.
        control: the deadline, stage check, stop flag and progress callback (``LoopControl``).
        batch_timeout_s: seconds without any new accepted group, batch or verdict after which it
            ends ``timed_out`` (a stalled pipeline: e.g. every generation worker gone); None: none.
    """

    def __init__(self, builder: BatchBuilder, events: BatchEvents | AgenticBatchEvents, *, max_steps: int,
                 min_fill_ratio: float, control: LoopControl = LoopControl(),
                 batch_timeout_s: float | None = None) -> None:
        self.builder = builder
        self.batch_timeout_s = batch_timeout_s
        self.events = events
        self.max_steps = max_steps
        self.min_fill_ratio = min_fill_ratio
        self.deadline = control.deadline
        self.check = control.check
        self.should_stop = control.should_stop
        self.on_progress = control.on_progress
        self.result = LoopResult()

    def batches(self) -> Iterator[tuple[RolloutBatch, bool]]:
        """Yield ``(batch, end_of_data)``: each batch to train, and whether it is the final
        partial batch of the data. Commit each (``BatchBuilder.commit``) before taking the next; a batch not
        committed stays uncommitted on the topic (a later run gets it again). ``result`` says how
        the loop ended once this is exhausted."""
        builder, result = self.builder, self.result
        progress = (time.monotonic(), builder.buffered)  # when the buffer last changed, and its size
        while builder.step < self.max_steps:
            self.check()
            if self.should_stop():
                result.outcome = "stopped"
                break
            if self.deadline is not None and time.monotonic() > self.deadline:
                result.outcome, result.detail = "timed_out", "time limit reached"
                break
            batch = builder.next_batch(timeout_s=POLL_S)
            if batch is not None or builder.buffered != progress[1]:
                progress = (time.monotonic(), builder.buffered)
            elif self.batch_timeout_s is not None and time.monotonic() - progress[0] > self.batch_timeout_s:
                result.outcome = "timed_out"
                result.detail = (f"no accepted group and no verdict for {self.batch_timeout_s:g} s (batch_timeout_s) "
                                 f"with {builder.buffered} of {builder.rollout_batch_size} groups of step {builder.step}")
                break
            if batch is not None:
                yield self._shown(batch), False
            for event in self.events.verdicts() if batch is None else []:
                end = event["status"] == "end_of_data"
                # A restarted trainer re-reads every verdict: one on a step its manifest already
                # has was answered before (an underfilled one is void; the data still ended).
                answered = event["step"] < builder.step
                if answered and not end:
                    continue
                if end:  # the full batches before the verdict's step precede it on the topics
                    while (builder.step < min(event["step"], self.max_steps)
                           and (full := builder.next_batch(CATCH_UP_S)) is not None):
                        yield self._shown(full), False
                action = "end" if answered else verdict_action(event, self.min_fill_ratio)
                if action == "ship_partial":
                    # the accepted groups precede the verdict on the topics; wait until they are read
                    partial = builder.take_partial(timeout_s=CATCH_UP_S, min_groups=event["accepted_groups"])
                    if partial is not None:
                        yield self._shown(partial), end
                if action != "ship_partial" or end:
                    result.outcome = "end_of_data" if end else "batch_underfilled"
                    result.detail = (
                        f"step {event['step']}: {event['accepted_groups']}/{event['target_groups']} groups after "
                        f"{event['prompts_consumed']} prompts (min_fill_ratio {self.min_fill_ratio}); "
                        f"rejected: {event['rejected_by_reason']}")
                    break
            self.on_progress(result, builder.buffered)
            if result.outcome != "complete":
                break

    def _shown(self, batch: RolloutBatch) -> RolloutBatch:
        """``batch``, once ``on_progress`` has counted its groups (in training from now on)."""
        self.on_progress(self.result, self.builder.buffered + len(batch.group_keys))
        return batch
