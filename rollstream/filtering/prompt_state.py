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
5. No prompt waits forever (``on_request``, ``on_tick``): the open round's GenerationRequest is
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
from rollstream.filtering.query_filters import query_decider
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
    return PromptState(
        prompt_id=response["prompt_id"], domain=response["domain"], mode=response.get("mode", "train"),
        num_return_sequences=n, expected=list(range(n)), next_sample_index=n,
    )


def open_from_request(request: Mapping[str, Any]) -> PromptState:
    """A state opened by its round-0 GenerationRequest (before any response arrived)."""
    n, offset = int(request["num_return_sequences"]), int(request.get("sample_offset", 0))
    return PromptState(prompt_id=request["prompt_id"], domain=request["domain"], mode=request.get("mode", "train"),
                       num_return_sequences=n, expected=list(range(offset, offset + n)), next_sample_index=offset + n)


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
        state = open_from_request(request)
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
    missing = state.num_return_sequences - len(state.accepted)
    if missing > 0 and state.rounds < filters.max_response_rounds:
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
        decision = (stale_decision(max(state.policy_version, 0), current_version, filters.max_staleness)
                    or filters.decide_query(metrics))
    state, decided = _decide(state, decision)
    return state, [*effects, *decided]


def _decide(state: PromptState, decision: Decision) -> tuple[PromptState, list[Effect]]:
    indices = state.accepted_indices
    return closed(state, decision.reason), [Decided(
        accepted=decision.keep, reason=decision.reason, values=dict(decision.values),
        sample_indices=indices, rounds=state.rounds,
        responses_generated=state.responses_generated,
        rejected_responses=dict(state.rejected_by_reason), policy_version=max(state.policy_version, 0),
        rewards=tuple(state.rewards[str(i)] for i in indices),
    )]
