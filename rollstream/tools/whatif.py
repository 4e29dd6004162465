"""`rollstream whatif`: what an alternative config's filters would have kept, decided offline
from recorded events, beside what actually happened. Nothing is written to any topic.

RLVR: each prompt's recorded ``responses.rewarded`` events go, in their recorded order, through
the same per-prompt state machine the aggregator runs (``filtering.prompt_state.step``) with the
alternative config's response filter, rounds and query filter. Responses have deterministic
identities (prompt_id, sample_index), so a replacement the alternative asks for is either in the
recording (the original asked for it too) or it is not: then the prompt ``needs_generation``
and cannot be decided offline (counted, listed, never guessed). Recorded responses the
alternative never asks for are generations it would have saved. ``stale`` rejections are
re-decided with the policy version recorded in their values; admission's ``prompt_too_long``
with the recorded prompt tokens (its ``decision_values["prompt_tokens"]``); a prompt the history
filter skipped stays skipped under the same ``history_filter`` and needs generation under another.

Only decision-plane events are read (``responses.rewarded``, ``groups.*``): rewards, scores,
finish reasons, lengths and policy versions are all in them; no token payload is fetched.

Agentic: each recorded trajectory group (accepted, or rejected by its group filter) goes
through the alternative config's group filter (``filtering.group_filters``), as the group queue
would have called it.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from rollstream.config import AgenticConfig, Config, RLVRConfig
from rollstream.filtering.admission import history_filter_config, prompt_length_decision
from rollstream.filtering.group_filters import filter_group, load_group_filter
from rollstream.filtering.prompt_state import Decided, DomainFilters, open_state, step
from rollstream.filtering.reasons import ACCEPTED, RejectReason
from rollstream.kafka.cluster import Bootstrap
from rollstream.kafka.topics import Topics
from rollstream.schemas.records import is_trajectory_group
from rollstream.tools.readback import read_values

GROUP_FILTER_REASONS = {RejectReason.ZERO_STD.value, RejectReason.DROP_FLAG.value, RejectReason.GROUP_FILTER.value,
                        RejectReason.FILTER_ERROR.value, ACCEPTED}


@dataclass(frozen=True)
class GroupOutcome:
    """One group's decision, as recorded or as the alternative config re-decides it."""

    accepted: bool
    reason: str
    responses_generated: int = 0  # responses (or trajectories) this decision consumed
    rounds: int = 0  # generation rounds it took (RLVR)


@dataclass
class Side:
    """The figures of one side (``actual`` or ``alternative``) over the train groups."""

    decided: int = 0
    accepted: int = 0
    reasons: Counter = field(default_factory=Counter)
    responses_generated: int = 0
    responses_in_accepted: int = 0
    rounds: int = 0

    def add(self, decision: GroupOutcome, group_size: int) -> None:
        self.decided += 1
        self.reasons[decision.reason] += 1
        self.responses_generated += decision.responses_generated
        self.rounds += decision.rounds
        if decision.accepted:
            self.accepted += 1
            self.responses_in_accepted += group_size

    def report(self, batch_size: int) -> dict:
        retention = self.accepted / self.decided if self.decided else 0.0
        return {
            "groups_decided": self.decided, "groups_accepted": self.accepted,
            "retention_rate": round(retention, 4),
            "prompts_per_batch": round(batch_size / retention, 2) if retention else None,
            "responses_generated": self.responses_generated, "rounds": self.rounds,
            "wasted_generations": self.responses_generated - self.responses_in_accepted,
            "reasons": dict(sorted(self.reasons.items())),
        }


@dataclass
class WhatIf:
    actual: Side = field(default_factory=Side)
    alternative: Side = field(default_factory=Side)
    changed: list[dict] = field(default_factory=list)  # {group_key, actual, alternative}
    needs_generation: list[str] = field(default_factory=list)
    saved_generations: int = 0  # recorded responses the alternative never asked for

    def report(self, batch_size: int) -> dict:
        return {"actual": self.actual.report(batch_size), "alternative": self.alternative.report(batch_size),
                "changed": self.changed, "needs_generation": self.needs_generation,
                "saved_generations": self.saved_generations}

    def compare(self, key: str, actual: GroupOutcome, alternative: GroupOutcome | None, group_size: int) -> None:
        self.actual.add(actual, group_size)
        if alternative is None:
            self.needs_generation.append(key)
            return
        self.alternative.add(alternative, group_size)
        if (actual.accepted, actual.reason) != (alternative.accepted, alternative.reason):
            self.changed.append({"group_key": key, "actual": actual.reason, "alternative": alternative.reason})


def whatif_rlvr(config: RLVRConfig, rewarded: Iterable[dict], decided_groups: Iterable[dict]) -> WhatIf:
    """``rewarded``: RewardedResponse records in recorded order; ``decided_groups``: the recorded
    Group records (accepted, then rejected: for a prompt in both, the first one counts, i.e. the
    aggregator's decision, not a later trainer-side ``stale``). Validation groups are skipped:
    they bypass every filter."""
    filters = config.domain_filters()
    actual: dict[str, dict] = {}
    for group in decided_groups:
        if group.get("mode", "train") == "train":
            actual.setdefault(group["prompt_id"], group)
    by_prompt: OrderedDict[str, list[dict]] = OrderedDict()
    for record in rewarded:
        response = record["response"]
        if response.get("mode", "train") == "train" and response["prompt_id"] in actual:
            by_prompt.setdefault(response["prompt_id"], []).append(record)
    out = WhatIf()
    for pid, group in actual.items():
        recorded = GroupOutcome(group["accepted"], group["reason"], group.get("responses_generated", 0),
                            group.get("rounds", 0))
        if group["domain"] not in filters:
            continue
        domain = filters[group["domain"]]
        if group["reason"] == RejectReason.SKIPPED_BY_HISTORY.value:
            out.compare(pid, recorded, _history_skip(group, config), 0)
            continue
        if group["reason"] == RejectReason.PROMPT_TOO_LONG.value or not by_prompt.get(pid):
            alternative = _admission(group, config)
            out.compare(pid, recorded, alternative, 0)
            continue
        alternative, used = _replay_prompt(by_prompt[pid], domain, _recorded_version(group))
        out.saved_generations += len(by_prompt[pid]) - used
        out.compare(pid, recorded, alternative, domain.num_return_sequences)
    return out


def _history_skip(group: Mapping, config: RLVRConfig) -> GroupOutcome | None:
    """A prompt the history filter skipped: skipped again when the alternative runs the same
    history filter (same ``filter_config_hash``: the same seeded draw on the same history);
    otherwise it would have been generated, which cannot be decided offline (None)."""
    if history_filter_config(config.history_filter.model_dump())[1] == group.get("filter_config_hash"):
        return GroupOutcome(False, group["reason"])
    return None


def _admission(group: Mapping, config: RLVRConfig) -> GroupOutcome | None:
    """A prompt decided before generation: only ``prompt_length`` applies; None when the
    alternative would admit it (its responses were never generated) or when the prompt's length
    is not recorded. The length is the ``prompt_tokens`` value of admission's
    ``prompt_too_long`` decision, else the ``prompt_length`` of one of the group's response
    summaries (no payload is read)."""
    tokens = _prompt_tokens(group)
    if tokens is None:
        return None
    verdict = prompt_length_decision(tokens, config.prompt_length)
    return None if verdict is None else GroupOutcome(verdict.keep, verdict.reason)


def _prompt_tokens(group: Mapping) -> int | None:
    """The prompt's (chat-templated) token count as recorded in a Group event, or None."""
    value = (group.get("decision_values") or {}).get("prompt_tokens")
    if value is not None:
        return int(value)
    for member in group.get("responses") or ():
        length = (member.get("response") or {}).get("prompt_length")
        if length:
            return int(length)
    return None


def _recorded_version(group: Mapping) -> int | None:
    """The newest policy version the aggregator knew when it rejected ``group`` as stale."""
    if group["reason"] != RejectReason.STALE.value:
        return None
    value = (group.get("decision_values") or {}).get("current_version")
    return None if value is None else int(value)


def _replay_prompt(records: list[dict], filters: DomainFilters, current_version: int | None
                   ) -> tuple[GroupOutcome | None, int]:
    """(decision, recorded responses consumed); decision None when a replacement it asks for
    was never generated. A recorded sample the alternative asks for only in a later round (its
    screening round asks for fewer than the recording's first round held) waits until that round
    is requested."""
    state, used, waiting = None, 0, list(records)
    while waiting:
        later = []
        for record in waiting:
            state = state or open_state(record, filters)
            if int(record["response"]["sample_index"]) not in state.expected:
                later.append(record)  # a later round's, a redelivery, or a sample never asked for
                continue
            state, effects = step(state, record, filters, current_version)
            used += 1
            for effect in effects:
                if isinstance(effect, Decided):
                    return GroupOutcome(effect.accepted, effect.reason, effect.responses_generated,
                                        effect.rounds), used
        if len(later) == len(waiting):
            break
        waiting = later
    return None, used


def whatif_agentic(config: AgenticConfig, decided_groups: Iterable[dict]) -> WhatIf:
    """``decided_groups``: recorded train TrajectoryGroups. Groups rejected for reasons outside
    the group filter (infra_abort, refill_exhausted, episode_timeout, stale, ...) are not
    re-decided: the group filter never saw them."""
    manager = config.train_env_manager
    group_filter = load_group_filter(manager.group_filter_cls, config, manager, "train")
    out = WhatIf()
    for group in decided_groups:
        if group.get("mode", "train") != "train" or group["reason"] not in GROUP_FILTER_REASONS:
            continue
        members = group["trajectories"]
        recorded = GroupOutcome(group["accepted"], group["reason"], group.get("trajectories_arrived", len(members)))
        drop, reason, _ = filter_group(group_filter, group["group_id"], group["episode_id"], members)
        alternative = GroupOutcome(not drop, reason if drop else ACCEPTED, recorded.responses_generated)
        out.compare(group["group_key"], recorded, alternative, len(members))
    return out


def run_whatif(config: Config, bootstrap: Bootstrap) -> dict:
    """Read the recorded topics of ``config``'s prefix and report (nothing is written)."""
    topics = Topics(config.kafka.topic_prefix)
    decided = read_values(bootstrap, topics.groups_accepted) + read_values(bootstrap, topics.groups_rejected)
    if isinstance(config, AgenticConfig):
        result = whatif_agentic(config, [g for g in decided if is_trajectory_group(g)])
        return {"pipeline": "agentic", **result.report(config.groups_per_batch)}
    result = whatif_rlvr(config, read_values(bootstrap, topics.responses_rewarded),
                         [g for g in decided if not is_trajectory_group(g)])
    return {"pipeline": "rlvr", **result.report(config.rollout_batch_size)}
