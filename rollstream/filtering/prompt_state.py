"""The per-prompt transaction of response aggregation, as a pure state machine.

``step(state, rewarded_response, config) -> (state, effects)``; the stream processor persists
``state`` (None = deleted) and carries out the effects. Same code runs in ``whatif``, tests and
benchmarks.

Lifecycle (the reference system's, with our differences):

1. The first response of a prompt opens the state expecting sample indices
   ``0 .. num_return_sequences-1`` (round 0).
2. Each response is checked by the response filter (validation bypasses it). A redelivered or
   unexpected sample index, or any response of an already decided prompt, is ignored and
   reported as a duplicate.
3. When every expected sample of the open round has arrived: if fewer than
   ``num_return_sequences`` responses were accepted, request exactly the missing count as a
   replacement round for the same prompt (new, deterministic sample indices), unless
   ``max_response_rounds`` rounds (in total, first one included) are used, in which case the
   prompt is aborted with ``response_retries_exhausted`` (the reference crashes here).
4. A complete group goes to the query filter (validation bypasses it): commit or abort.
5. Two-phase screening (``screening_samples`` k, per domain; off by default): a train prompt's
   round 0 asks for its first k samples only. When all k are accepted by the response filter,
   their filter metrics are equal, and the query filter rejects them, the prompt is decided
   ``screened_out`` from those k: the other samples are never generated. Otherwise the missing
   samples are requested as the next round and the group is decided on all of them, as without
   screening. The screening round is not counted in ``max_response_rounds``. With
   ``screening_diagnose`` the missing samples are generated anyway and a screened-out group
   records whether the full group's decision would have kept it (``full_group_kept``): the
   false-rejection rate. (SPEED-RL, arXiv 2506.09016, screens prompts the same way.)
6. No prompt waits forever (``on_request``, ``on_tick``): the open round's GenerationRequest is
   kept in the state with a deadline, ``prompt_timeout_ms`` after the request was seen. At the
   deadline the same request (round, seed, sample indices) is issued again, at most
   ``max_reissues`` times per prompt; samples that did arrive come back as duplicates and are
   ignored. After the last reissue the prompt is aborted with ``prompt_timeout``. A state may be
   opened by the round-0 request or by a response, whichever comes first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Mapping, Sequence, Union

from rollstream.filtering.decision import Decision
from rollstream.filtering.query_filters import f32, query_decider
from rollstream.filtering.reasons import RejectReason
from rollstream.filtering.response_filters import response_decider
from rollstream.filtering.staleness import stale_decision

REWARD_METRIC = "response_level_reward"


@dataclass(frozen=True)
class DomainFilters:
    """What the aggregator needs to decide one domain's prompts."""

    num_return_sequences: int
    response_filter_config: Mapping[str, Any] = field(default_factory=lambda: {"type": "default"})
    query_filter_config: Mapping[str, Any] = field(default_factory=lambda: {"type": "no_filter"})
    max_response_rounds: int = 5
    val_num_return_sequences: int = 1
    max_staleness: int | None = None  # policy versions; None = unbounded (filtering/staleness.py)
    prompt_timeout_ms: int = 600_000  # a round's samples not all back this long after its request: reissue
    max_reissues: int = 2  # deadline reissues per prompt; then abort prompt_timeout
    screening_samples: int = 0  # k: a train group's first round asks for k samples (0: no screening)
    screening_diagnose: bool = False  # generate a screened-out group in full, to measure false rejections

    def __post_init__(self) -> None:
        """Raises ValueError for screening samples outside [2, num_return_sequences)."""
        k = self.screening_samples
        if k and not 2 <= k < self.num_return_sequences:
            raise ValueError(f"screening_samples must be in [2, {self.num_return_sequences}), got {k}")

    def first_round(self, mode: str) -> int:
        """Samples a prompt's round 0 asks for: k while screening a train prompt, else the group."""
        if mode == "val":
            return self.val_num_return_sequences
        return self.screening_samples or self.num_return_sequences

    @property
    def metric(self) -> str:
        """Field the query filter reads: response_level_reward or a key of the reward's scores."""
        return self.query_filter_config.get("metric", REWARD_METRIC)

    @cached_property
    def decide_response(self) -> Callable[[Mapping[str, Any]], Decision]:
        """The response filter, resolved once (``rewarded -> Decision``)."""
        return response_decider(self.response_filter_config)

    @cached_property
    def decide_query(self) -> Callable[[Sequence[float]], Decision]:
        """The query filter, resolved once (``rewards -> Decision``)."""
        return query_decider(self.query_filter_config)


@dataclass
class PromptState:
    prompt_id: str
    domain: str
    mode: str
    num_return_sequences: int
    rounds: int = 1
    expected: list[int] = field(default_factory=list)
    accepted: dict[str, float] = field(default_factory=dict)  # sample_index -> filter metric
    rewards: dict[str, float] = field(default_factory=dict)  # sample_index -> response_level_reward
    rejected_by_reason: dict[str, int] = field(default_factory=dict)
    responses_generated: int = 0
    next_sample_index: int = 0
    policy_version: int = -1  # oldest policy version among accepted responses
    decided: str | None = None  # set once decided: a closed transaction ignores redeliveries
    request: dict | None = None  # the open round's GenerationRequest, reissued as is at the deadline
    deadline_ms: int = 0  # when the open round times out (epoch ms; 0: no request seen yet)
    reissues: int = 0  # deadline reissues so far
    screening: int = 0  # k when round 0 screened the first k samples (0: not screened)
    screened: dict | None = None  # screening_diagnose: the screened_out decision's values, decided at the end

    def to_dict(self) -> dict:
        return dict(self.__dict__)  # fields are plain JSON types; asdict's deep copy is 5x slower

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "PromptState":
        return cls(**data)

    @property
    def accepted_indices(self) -> list[int]:
        return sorted(int(i) for i in self.accepted)


# ---- effects -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResponseAccepted:
    sample_index: int


@dataclass(frozen=True)
class ResponseRejected:
    sample_index: int
    reason: str


@dataclass(frozen=True)
class DuplicateResponse:
    sample_index: int


@dataclass(frozen=True)
class Replacement:
    """Ask for ``num_return_sequences`` more samples of the prompt."""

    round: int  # 0-based round number of the new request
    num_return_sequences: int
    sample_offset: int


@dataclass(frozen=True)
class Reissue:
    """Issue the open round's GenerationRequest again (``request``, unchanged: the same round,
    seed and sample indices); ``reissue`` counts the prompt's reissues (1, 2, ...)."""

    request: Mapping[str, Any]
    reissue: int


@dataclass(frozen=True)
class Decided:
    """The prompt's transaction ends: commit (accepted) or abort."""

    accepted: bool
    reason: str
    values: Mapping[str, float]
    sample_indices: list[int]
    rounds: int
    responses_generated: int
    rejected_responses: Mapping[str, int]
    policy_version: int
    rewards: tuple[float, ...] = ()  # response_level_reward of the kept responses, in sample order


Effect = Union[ResponseAccepted, ResponseRejected, DuplicateResponse, Replacement, Reissue, Decided]


def _metric_value(rewarded: Mapping[str, Any], metric: str) -> float:
    if metric == REWARD_METRIC:
        value = rewarded.get(REWARD_METRIC)
    else:
        value = (rewarded.get("scores") or {}).get(metric)
    return math.nan if value is None else float(value)


def open_state(rewarded: Mapping[str, Any], filters: DomainFilters) -> PromptState:
    response = rewarded["response"]
    val = response.get("mode", "train") == "val"
    n = filters.val_num_return_sequences if val else filters.num_return_sequences
    first = filters.first_round(response.get("mode", "train"))
    return PromptState(
        prompt_id=response["prompt_id"], domain=response["domain"], mode=response.get("mode", "train"),
        num_return_sequences=n, expected=list(range(first)), next_sample_index=first,
        screening=first if first < n else 0,
    )


def open_from_request(request: Mapping[str, Any], filters: DomainFilters) -> PromptState:
    """A state opened by its round-0 GenerationRequest (before any response arrived); a train
    request for ``screening_samples`` samples opens the screening round of the domain's group."""
    k, offset = int(request["num_return_sequences"]), int(request.get("sample_offset", 0))
    mode = request.get("mode", "train")
    screening = mode == "train" and 0 < k == filters.screening_samples
    return PromptState(prompt_id=request["prompt_id"], domain=request["domain"], mode=mode,
                       num_return_sequences=filters.num_return_sequences if screening else k,
                       expected=list(range(offset, offset + k)), next_sample_index=offset + k,
                       screening=k if screening else 0)


def on_request(state: PromptState | None, request: Mapping[str, Any], filters: DomainFilters,
               now_ms: int) -> tuple[PromptState | None, bool]:
    """A GenerationRequest of the prompt (round 0 from admission, or a replacement or reissue
    coming back): the open round's request is kept, with its deadline ``prompt_timeout_ms``
    from ``now_ms``, the first time it is seen. Returns the state and whether it changed. A
    request of another round, of a decided prompt, or of a prompt without state beyond round 0
    (decided and forgotten) changes nothing."""
    rnd = int(request["round"])
    if state is None:
        if rnd != 0:
            return None, False
        state = open_from_request(request, filters)
    if state.decided is not None or state.request is not None or rnd != state.rounds - 1:
        return state, False
    return with_request(state, request, filters, now_ms), True


def with_request(state: PromptState, request: Mapping[str, Any], filters: DomainFilters,
                 now_ms: int) -> PromptState:
    """``state`` waiting for ``request`` (its open round's), due ``prompt_timeout_ms`` from now."""
    state.request = {k: v for k, v in request.items() if k != "created_ms"}
    state.deadline_ms = now_ms + filters.prompt_timeout_ms
    return state


def on_tick(state: PromptState, filters: DomainFilters, now_ms: int) -> tuple[PromptState, list[Effect]]:
    """Check the open round's deadline at ``now_ms``: past it, ``Reissue`` the round's request
    (while reissues are left) or abort the prompt ``prompt_timeout`` with what it has (values:
    reissues, missing samples, accepted responses, rounds). Nothing changes before the deadline,
    for a decided prompt, or without a request."""
    if state.decided is not None or state.request is None or now_ms < state.deadline_ms:
        return state, []
    if state.reissues < filters.max_reissues:
        state.reissues += 1
        state.deadline_ms = now_ms + filters.prompt_timeout_ms
        return state, [Reissue(dict(state.request), state.reissues)]
    decision = Decision.reject(RejectReason.PROMPT_TIMEOUT, reissues=float(state.reissues),
                               missing=float(len(state.expected)), accepted=float(len(state.accepted)),
                               rounds=float(state.rounds))
    return _decide(state, decision)


def closed(state: PromptState, reason: str) -> PromptState:
    """The compact record of a decided prompt, kept a while so redelivered responses (at-least-once
    delivery after a crash or rebalance) cannot reopen the transaction."""
    return PromptState(state.prompt_id, state.domain, state.mode, state.num_return_sequences,
                       rounds=state.rounds, decided=reason)


def step(
    state: PromptState | None, rewarded: Mapping[str, Any], filters: DomainFilters,
    current_version: int | None = None,
) -> tuple[PromptState, list[Effect]]:
    """Apply one RewardedResponse record; returns the new state (closed once decided) and effects.

    ``current_version`` is the newest published policy version (None: unknown); a training group
    whose oldest response lags it by more than ``filters.max_staleness`` is rejected ``stale``
    before its query filter runs."""
    if state is None:
        state = open_state(rewarded, filters)
    response = rewarded["response"]
    index = int(response["sample_index"])
    if state.decided is not None or index not in state.expected:
        return state, [DuplicateResponse(index)]
    state.expected.remove(index)
    state.responses_generated += 1
    effects: list[Effect] = []
    validation = state.mode == "val"
    decision = Decision.accept() if validation else filters.decide_response(rewarded)
    if decision.keep:
        state.accepted[str(index)] = _metric_value(rewarded, filters.metric)
        reward = rewarded.get(REWARD_METRIC)
        state.rewards[str(index)] = math.nan if reward is None else float(reward)
        version = int(response.get("policy_version", 0))
        state.policy_version = version if state.policy_version < 0 else min(state.policy_version, version)
        effects.append(ResponseAccepted(index))
    else:
        state.rejected_by_reason[decision.reason] = state.rejected_by_reason.get(decision.reason, 0) + 1
        effects.append(ResponseRejected(index, decision.reason))
    if state.expected:
        return state, effects
    return _round_complete(state, filters, effects, current_version)


def _round_complete(
    state: PromptState, filters: DomainFilters, effects: list[Effect], current_version: int | None
) -> tuple[PromptState, list[Effect]]:
    if state.screening and state.rounds == 1:
        screened = screening_decision([state.accepted[str(i)] for i in state.accepted_indices], state.screening,
                                      filters)
        if screened is not None and not filters.screening_diagnose:
            decision = _stale(state, filters, current_version) or screened
            state, decided = _decide(state, decision)
            return state, [*effects, *decided]
        state.screened = None if screened is None else dict(screened.values)
    missing = state.num_return_sequences - len(state.accepted)
    if missing > 0 and state.rounds < filters.max_response_rounds + (1 if state.screening else 0):
        replacement = Replacement(state.rounds, missing, state.next_sample_index)
        state.request, state.deadline_ms = None, 0  # the shell records the replacement's request
        state.expected = list(range(state.next_sample_index, state.next_sample_index + missing))
        state.next_sample_index += missing
        state.rounds += 1
        return state, [*effects, replacement]
    indices = state.accepted_indices
    if missing > 0:
        decision = Decision.reject(
            RejectReason.RESPONSE_RETRIES_EXHAUSTED,
            accepted=float(len(state.accepted)), needed=float(state.num_return_sequences),
            rounds=float(state.rounds),
        )
    elif state.mode == "val":
        decision = Decision.accept()
    else:
        metrics = [state.accepted[str(i)] for i in indices]
        decision = _stale(state, filters, current_version) or filters.decide_query(metrics)
    if state.screened is not None:  # screening_diagnose: rejected as screened, told what the full group got
        decision = Decision.reject(RejectReason.SCREENED_OUT, **state.screened, full_group_kept=float(decision.keep))
    elif state.screening and decision.keep:
        decision = Decision.accept(**decision.values, screening_samples=float(state.screening))
    state, decided = _decide(state, decision)
    return state, [*effects, *decided]


def _stale(state: PromptState, filters: DomainFilters, current_version: int | None) -> Decision | None:
    """The ``stale`` rejection of a train group by its oldest kept response, or None."""
    return stale_decision(max(state.policy_version, 0), current_version, filters.max_staleness)


def screening_decision(metrics: Sequence[float], k: int, filters: DomainFilters) -> Decision | None:
    """The ``screened_out`` rejection of a group from the filter metrics of its first ``k``
    accepted samples, or None when they do not decide it: fewer than ``k`` accepted (errors are
    the response filter's: replaced, never read as zero variance), a non-finite or unequal
    value (compared in float32, as the filters compare), or a query filter that keeps ``k``
    equal values. Values: the filter's own (mean, std, thresholds) and ``screening_samples``."""
    if len(metrics) < k or len({f32(m) for m in metrics}) != 1 or not math.isfinite(f32(metrics[0])):
        return None
    decision = filters.decide_query(metrics)
    if decision.keep:
        return None
    return Decision.reject(RejectReason.SCREENED_OUT, **decision.values, screening_samples=float(k))


def _decide(state: PromptState, decision: Decision) -> tuple[PromptState, list[Effect]]:
    indices = state.accepted_indices
    return closed(state, decision.reason), [Decided(
        accepted=decision.keep, reason=decision.reason, values=dict(decision.values),
        sample_indices=indices, rounds=state.rounds,
        responses_generated=state.responses_generated,
        rejected_responses=dict(state.rejected_by_reason), policy_version=max(state.policy_version, 0),
        rewards=tuple(state.rewards[str(i)] for i in indices),
    )]
