"""Admission: credit-based prompt concurrency and the bounded resampling budget, as pure state.

A prompt is a transaction: admitted (takes a credit) -> commit or abort on ``prompt.outcomes``
(returns the credit). For the training step being filled (``rollout_batch_size`` accepted
groups), admission:

* keeps at most ``max_running_prompts`` prompts in flight;
* stops admitting once ``accepted + in_flight`` covers the batch plus
  ``max_additional_running_prompts`` (no refill wave: a rejection frees exactly one slot, so
  exactly one new prompt replaces it);
* with ``oversample_by_yield``, keeps the batch's deficit divided by the recent yield in flight
  instead (``in_flight_target``): when three of four prompts are rejected, a deficit of 2 puts 8
  prompts in flight at once rather than 2 at a time, one rejection after another. The yield is
  the accepted share of the last ``YIELD_WINDOW`` generated train prompts (1 before any);
  GRESO's adaptive rollout batch (arXiv 2506.02177) sizes its batch the same way;
* starts the prompts of step s only once policy version ``s - max_staleness`` is published
  (filtering/staleness.py), so generation never runs further ahead of the trainer than that;
* spends at most ``max_prompts_per_batch`` training prompts on one batch. When the budget is
  spent and nothing of the step is in flight while the batch is short, the step ends with a
  ``BatchUnderfilled`` verdict instead of resampling forever (the reference has no cap).

End of data and epochs: the ``PromptsEnd`` marker on ``prompts`` ends the first read (epoch 0).
For epochs 1..``num_epochs``-1 the shell re-reads the train prompts that preceded it, in the
order ``epoch_order`` gives (seeded per epoch), as new transactions ``<prompt_id>#e<epoch>``;
validation prompts are not repeated. The epoch and the position in its order live in the state,
so a restarted admission resumes where it stopped. Once the last epoch's prompts are all taken
and every admitted prompt is decided, the step being filled ends with exactly one ``EndOfData``
verdict (its accepted groups, possibly 0 when the previous step completed on the last prompt).
When ``max_steps`` batches are complete first, admission is finished and no verdict follows:
the trainer ends ``complete`` on its step count.

Periodic validation (``eval_steps``): the validation prompts are admitted once at their first
read (the round of version 0), and again, as ``<prompt_id>#v<version>``, each time a policy
version ``v`` is published with ``v // eval_steps`` above the last round's (``eval_due``); the
round's version and position live in the state like the epochs'. A round is admitted whole,
without waiting for a slot, so the version it validates generates all of it (the generation
worker keeps those weights while it serves the round); its prompts in flight still fill the
slots train prompts wait for. Validation never counts towards a batch and bypasses every filter.

History-aware admission (``history_filter``, rollstream.filtering.history): from epoch 1 on, a
prompt whose recent groups were zero-variance may be skipped before generation
(``skip_by_history``): it takes no slot and no budget, is counted in ``skipped_by_history`` and
recorded as a rejected Group with reason ``skipped_by_history``.

Accepted groups are never thrown away: a group accepted beyond the target counts towards the
next step (the trainer takes groups in the order they come), unless a staleness bound is set and
the next step may not train it: then it does not count (that step is generated in full by a
fresh enough policy), and the trainer rejects it as ``stale``, counted (the reference discards
such leftovers silently at gc). Whether it may is judged on the oldest version that generated
it, as the trainer judges it; a late group whose version is not known does not count.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Any, ClassVar, Mapping, Union

from rollstream.filtering.decision import Decision, config_hash
from rollstream.filtering.reasons import RejectReason
from rollstream.filtering.staleness import may_start_step, stale_decision


YIELD_WINDOW = 32  # generated train prompts the yield is taken over: a few steps' worth, so it follows epochs


@dataclass(frozen=True)
class AdmissionLimits:
    rollout_batch_size: int
    max_running_prompts: int
    max_prompts_per_batch: int
    max_additional_running_prompts: int = 0  # over-provisioning beyond the batch's deficit
    max_steps: int | None = None  # stop admitting training prompts after this many batches
    max_staleness: int | None = None  # policy versions generation may run ahead; None = unbounded
    num_epochs: int = 1  # passes over the train prompts before the PromptsEnd marker
    seed: int = 0  # seeds each epoch's order (epoch_order)
    eval_steps: int | None = None  # a validation round every this many policy versions; None: only the first
    oversample_by_yield: bool = False  # keep deficit / recent yield in flight (module doc)

    def __post_init__(self) -> None:
        for name in ("rollout_batch_size", "max_running_prompts", "max_prompts_per_batch", "num_epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_prompts_per_batch < self.rollout_batch_size:
            raise ValueError("max_prompts_per_batch must be >= rollout_batch_size")
        if self.eval_steps is not None and self.eval_steps < 1:
            raise ValueError(f"eval_steps must be >= 1, got {self.eval_steps}")


@dataclass
class AdmissionState:
    step: int = 0
    in_flight: dict[str, int] = field(default_factory=dict)  # prompt_id -> step (-1 = val)
    admitted_ms: dict[str, int] = field(default_factory=dict)  # prompt_id in flight -> when it was admitted
    admitted_in_step: int = 0
    accepted_in_step: int = 0
    rejected_in_step: dict[str, int] = field(default_factory=dict)
    prompts_admitted: int = 0
    val_admitted: int = 0
    finished: bool = False  # max_steps batches complete: no more training prompts
    end_offset: int | None = None  # offset of the PromptsEnd marker on ``prompts``, once read
    epoch_size: int = 0  # train prompts before the marker (each later epoch re-reads them)
    epoch: int = 0  # the epoch being admitted (0: the first read of the topic)
    epoch_position: int = 0  # prompts of ``epoch`` taken from its order so far (epoch >= 1)
    ended: bool = False  # the EndOfData verdict was given
    skipped_by_history: int = 0  # train prompts the history filter skipped before generation
    skip_run: int = 0  # of them skipped at ``skip_run_version`` (history_pass_done)
    skip_run_version: int = 0
    explore: dict | None = None  # the history filter's ExploreState (None: not started)
    eval_version: int = 0  # the policy version of the newest validation round (0: the first read)
    eval_size: int = 0  # validation prompts in that round (0 for the first read)
    eval_position: int = 0  # of them admitted so far
    recent_outcomes: list[int] = field(default_factory=list)  # the last YIELD_WINDOW train outcomes (1: accepted)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "AdmissionState":
        return cls(**data)

    def train_in_flight(self) -> int:
        return sum(1 for s in self.in_flight.values() if s >= 0)

    def recent_yield(self) -> float:
        """The accepted share of the last ``YIELD_WINDOW`` generated train prompts; 1.0 before any."""
        return sum(self.recent_outcomes) / len(self.recent_outcomes) if self.recent_outcomes else 1.0


@dataclass(frozen=True)
class StepComplete:
    """The step's batch is full: ``accepted`` (= the target) groups after ``prompts_consumed``
    prompts. The shell logs it; the trainer learns of the batch from the groups themselves."""

    step: int
    accepted: int
    prompts_consumed: int
    rejected_by_reason: Mapping[str, int]


@dataclass(frozen=True)
class StepVerdict:
    """The step being filled ends short of its batch with ``accepted`` (< ``target``) groups after
    ``prompts_consumed`` prompts: the shell publishes ``Batch(status=<status>)``, the verdict the
    trainer acts on (``min_fill_ratio``)."""

    status: ClassVar[str]
    step: int
    accepted: int
    target: int
    prompts_consumed: int
    rejected_by_reason: Mapping[str, int]


class BatchUnderfilled(StepVerdict):
    """The step's resampling budget is spent."""

    status = "underfilled"


@dataclass(frozen=True)
class UnknownOutcome:
    """An outcome for a prompt not in flight (a redelivery): ignored."""

    prompt_id: str


class EndOfData(StepVerdict):
    """The last epoch's prompts are all decided."""

    status = "end_of_data"


@dataclass(frozen=True)
class ExtraEnd:
    """A PromptsEnd marker at ``offset`` after the one that ended the data: ignored."""

    offset: int


AdmissionEffect = Union[StepComplete, BatchUnderfilled, EndOfData, ExtraEnd, UnknownOutcome]


def epoch_order(count: int, seed: int, epoch: int) -> list[int]:
    """The order in which epoch ``epoch`` (>= 1) re-reads the ``count`` train prompts: indices
    into them in first-read order, shuffled by ``random.Random(f"{seed}/{epoch}")``."""
    return list(_epoch_order(count, seed, epoch))


@lru_cache(maxsize=2)  # next_replay asks once per admitted prompt: shuffle once per epoch
def _epoch_order(count: int, seed: int, epoch: int) -> tuple[int, ...]:
    order = list(range(count))
    random.Random(f"{seed}/{epoch}").shuffle(order)
    return tuple(order)


def epoch_prompt_id(prompt_id: str, epoch: int) -> str:
    """The transaction id of ``prompt_id`` in ``epoch``: itself in epoch 0, else
    ``<prompt_id>#e<epoch>`` (the aggregator and the trainer key groups by prompt_id)."""
    return prompt_id if epoch == 0 else f"{prompt_id}#e{epoch}"


def on_data_end(state: AdmissionState, limits: AdmissionLimits, offset: int,
                epoch_size: int) -> tuple[AdmissionState, list[AdmissionEffect]]:
    """The PromptsEnd marker at ``offset``, preceded by ``epoch_size`` train prompts.

    The first marker ends epoch 0 (epoch 1 starts, if any); the same marker again (a redelivery
    after a restart) changes nothing, so the epochs resume at the saved position; a later marker
    is ``ExtraEnd``. May give the ``EndOfData`` verdict (see check_step)."""
    if state.end_offset is None:
        state.end_offset, state.epoch_size, state.epoch, state.epoch_position = offset, epoch_size, 1, 0
    elif offset != state.end_offset:
        return state, [ExtraEnd(offset)]
    return check_step(state, limits)


def next_replay(state: AdmissionState, limits: AdmissionLimits) -> tuple[int, int] | None:
    """``(epoch, index)``: the next train prompt to re-read (``index`` in first-read order), or
    None before the marker and once every epoch is through. Call ``take_replay`` when it was
    admitted or rejected."""
    if state.end_offset is None or state.epoch_size == 0:
        return None
    epoch, position = state.epoch, state.epoch_position
    if position >= state.epoch_size:
        epoch, position = epoch + 1, 0
    if epoch >= limits.num_epochs:
        return None
    return epoch, _epoch_order(state.epoch_size, limits.seed, epoch)[position]


def take_replay(state: AdmissionState, limits: AdmissionLimits) -> AdmissionState:
    """The prompt ``next_replay`` named was admitted or rejected: move past it (saved with the
    admission itself, so a restart neither repeats nor skips it)."""
    nxt = next_replay(state, limits)
    if nxt is None:
        raise ValueError("no epoch prompt left to take")
    if nxt[0] != state.epoch:
        state.epoch, state.epoch_position = nxt[0], 0
    state.epoch_position += 1
    return state


def eval_prompt_id(prompt_id: str, version: int) -> str:
    """The transaction id of validation prompt ``prompt_id`` in the round of ``version``: itself
    for the first read (version 0), else ``<prompt_id>#v<version>``."""
    return prompt_id if version == 0 else f"{prompt_id}#v{version}"


def eval_version_of(prompt_id: str) -> int:
    """The validation round (policy version) of a validation transaction id; 0 for a plain id."""
    base, sep, version = prompt_id.rpartition("#v")
    return int(version) if sep and version.isdigit() else 0


def eval_due(state: AdmissionState, limits: AdmissionLimits, policy_version: int | None) -> int | None:
    """The policy version a new validation round should run for, or None: none is configured, no
    version is published, the newest is in the round already validated (``v // eval_steps`` not
    above the last round's), or the last round's prompts are not all admitted yet."""
    if limits.eval_steps is None or policy_version is None or state.eval_position < state.eval_size:
        return None
    if policy_version // limits.eval_steps <= state.eval_version // limits.eval_steps:
        return None
    return policy_version


def start_eval(state: AdmissionState, version: int, size: int) -> AdmissionState:
    """A validation round of ``size`` prompts starts for ``version`` (``eval_due`` said so)."""
    state.eval_version, state.eval_size, state.eval_position = version, size, 0
    return state


def next_eval(state: AdmissionState) -> int | None:
    """Index (in first-read order) of the next validation prompt of the running round, or None."""
    return state.eval_position if state.eval_position < state.eval_size else None


def take_eval(state: AdmissionState) -> AdmissionState:
    """The prompt ``next_eval`` named was admitted (or rejected before generation)."""
    if next_eval(state) is None:
        raise ValueError("no validation prompt left to take")
    state.eval_position += 1
    return state


def skip_by_history(state: AdmissionState, version: int = 0) -> AdmissionState:
    """A train prompt of a later epoch skipped by the history filter at policy ``version``: no
    slot, no budget; it extends the run of skips at that version (history_pass_done)."""
    if version != state.skip_run_version:
        state.skip_run, state.skip_run_version = 0, version
    state.skip_run += 1
    state.skipped_by_history += 1
    return state


def history_pass_done(state: AdmissionState, version: int) -> bool:
    """The history filter has skipped an epoch's worth of train prompts at ``version``: judging
    them again before the policy changes would decide the same. Until a new version, admission
    takes the next prompt in order one at a time, each once nothing is in flight (the batch
    cannot fill otherwise), instead of passing over the data again and again."""
    return 0 < state.epoch_size <= state.skip_run and version == state.skip_run_version


def data_done(state: AdmissionState, limits: AdmissionLimits) -> bool:
    """The marker was read and every epoch's prompts were taken."""
    return state.end_offset is not None and next_replay(state, limits) is None


def prompt_length_decision(prompt_tokens: int, prompt_length: int) -> Decision | None:
    """The filter admission runs before generation: a prompt of more than ``prompt_length``
    (chat-templated) tokens is rejected ``prompt_too_long``, with values ``prompt_tokens`` and
    ``prompt_length``. None: the prompt may be admitted."""
    if prompt_tokens > prompt_length:
        return Decision.reject(RejectReason.PROMPT_TOO_LONG, prompt_tokens=float(prompt_tokens),
                               prompt_length=float(prompt_length))
    return None


def prompt_filter_config(prompt_length: int) -> tuple[str, str]:
    """``(filter_config, filter_config_hash)`` a ``prompt_too_long`` Group carries: the JSON of
    what decided it (so it can be re-decided) and its sha256[:16]."""
    text = json.dumps({"prompt_length": prompt_length})
    return text, config_hash(text)


def history_filter_config(history_filter: Mapping[str, Any]) -> tuple[str, str]:
    """``(filter_config, filter_config_hash)`` a ``skipped_by_history`` Group carries."""
    text = json.dumps({"history_filter": dict(history_filter)}, sort_keys=True)
    return text, config_hash(text)


def oldest_admission_ms(state: AdmissionState) -> int | None:
    """When the longest-running prompt in flight was admitted (epoch ms); None when none is.
    An outcome of a prompt in flight cannot be older than this."""
    return min((state.admitted_ms.get(p, 0) for p in state.in_flight), default=None)


def can_admit(state: AdmissionState, limits: AdmissionLimits, mode: str = "train",
              policy_version: int | None = None) -> bool:
    """Whether a prompt of ``mode`` may be admitted now; ``policy_version`` is the newest
    published one (None: none yet)."""
    if mode == "val":  # a round is admitted whole, so the version it validates generates all of it
        return True
    # A round never takes the train slots: holding them until it was decided made the next
    # batch's prompts wait for every sample of the round (its size is the validation set's).
    if state.train_in_flight() >= limits.max_running_prompts:
        return False
    if state.finished or state.ended or not may_start_step(state.step, policy_version, limits.max_staleness):
        return False
    return (state.train_in_flight() < in_flight_target(state, limits)
            and state.admitted_in_step < limits.max_prompts_per_batch)


def in_flight_target(state: AdmissionState, limits: AdmissionLimits) -> int:
    """Train prompts the step being filled may have in flight (before ``max_running_prompts``):
    its deficit plus ``max_additional_running_prompts``; with ``oversample_by_yield`` the deficit
    divided by ``recent_yield`` (rounded up) plus the same (module doc)."""
    deficit = max(limits.rollout_batch_size - state.accepted_in_step, 0)
    if limits.oversample_by_yield and deficit:
        rate = state.recent_yield()
        deficit = limits.max_running_prompts if rate <= 0 else math.ceil(deficit / rate - 1e-9)
    return deficit + limits.max_additional_running_prompts


def admit(state: AdmissionState, prompt_id: str, mode: str = "train", now_ms: int = 0) -> AdmissionState:
    """Take a credit for ``prompt_id`` at ``now_ms`` (epoch ms); call only when can_admit says so."""
    state.admitted_ms[prompt_id] = now_ms
    if mode == "val":
        state.in_flight[prompt_id] = -1
        state.val_admitted += 1
    else:
        state.in_flight[prompt_id] = state.step
        state.admitted_in_step += 1
    state.prompts_admitted += 1
    return state


def reject_before_generation(state: AdmissionState, reason: str, mode: str = "train") -> AdmissionState:
    """A prompt filtered at admission (e.g. prompt_too_long): it consumes budget, never a slot."""
    if mode != "val":
        state.admitted_in_step += 1
        state.rejected_in_step[reason] = state.rejected_in_step.get(reason, 0) + 1
    return state


def on_outcome(
    state: AdmissionState, limits: AdmissionLimits, prompt_id: str, committed: bool, reason: str,
    policy_version: int | None = None,
) -> tuple[AdmissionState, list[AdmissionEffect]]:
    """Return the prompt's credit; may complete or underfill the step. ``policy_version``: the
    oldest version that generated a committed group; one the trainer will reject ``stale`` when
    it trains the step (the same bound, judged against the step) counts as a rejection, so the
    step is refilled instead of waiting for a batch the trainer can never complete."""
    step = state.in_flight.pop(prompt_id, None)
    state.admitted_ms.pop(prompt_id, None)
    if step is None:
        return state, [UnknownOutcome(prompt_id)]
    if step < 0:  # validation: counts towards no batch, only towards the end of data
        return check_step(state, limits)
    known = policy_version is not None and policy_version >= 0
    if committed and known and stale_decision(policy_version, step, limits.max_staleness) is not None:
        committed, reason = False, RejectReason.STALE.value
    state.recent_outcomes = (state.recent_outcomes + [int(committed)])[-YIELD_WINDOW:]
    if step == state.step:
        if committed:
            state.accepted_in_step += 1
        else:
            state.rejected_in_step[reason] = state.rejected_in_step.get(reason, 0) + 1
    elif committed and (limits.max_staleness is None or (
            known and stale_decision(policy_version, state.step, limits.max_staleness) is None)):
        # a late prompt of an earlier step: its group counts now, if the step being filled may
        # still train it (see the module doc)
        state.accepted_in_step += 1
    return check_step(state, limits)


def check_step(state: AdmissionState, limits: AdmissionLimits) -> tuple[AdmissionState, list[AdmissionEffect]]:
    """Close the step if its batch is full, or if the budget is spent and nothing is pending;
    then give the ``EndOfData`` verdict (once) when the data is done and nothing is in flight."""
    effects: list[AdmissionEffect] = []
    target = limits.rollout_batch_size
    if state.ended:
        return state, effects
    while not state.finished and state.accepted_in_step >= target:  # a carry may fill the next one too
        effects.append(StepComplete(state.step, target, state.admitted_in_step, dict(state.rejected_in_step)))
        carry = state.accepted_in_step - target if limits.max_staleness is None else 0
        _advance(state, limits, carry)
    if state.finished:
        return state, effects
    if state.admitted_in_step >= limits.max_prompts_per_batch and state.train_in_flight() == 0:
        effects.append(BatchUnderfilled(
            state.step, state.accepted_in_step, target, state.admitted_in_step, dict(state.rejected_in_step)
        ))
        _advance(state, limits, 0)
    if not state.finished and not state.in_flight and data_done(state, limits) and next_eval(state) is None:
        effects.append(EndOfData(
            state.step, state.accepted_in_step, target, state.admitted_in_step, dict(state.rejected_in_step)
        ))
        state.ended = True
    return state, effects


def _advance(state: AdmissionState, limits: AdmissionLimits, carry: int) -> None:
    state.step += 1
    state.accepted_in_step = carry
    state.admitted_in_step = 0
    state.rejected_in_step = {}
    if limits.max_steps is not None and state.step >= limits.max_steps:
        state.finished = True
