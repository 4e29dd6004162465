"""Pure builders of the records the stream processors emit (dicts matching the .avsc files)."""

from __future__ import annotations

import zlib
from typing import Mapping, Sequence

from rollstream.filtering.history import reward_pattern
from rollstream.filtering.prompt_state import Decided, Replacement
from rollstream.filtering.reasons import ACCEPTED
from rollstream.runtime import now_ms


def generation_request(prompt: Mapping, *, round_: int, num_return_sequences: int,
                       sample_offset: int, seed: int) -> dict:
    """A GenerationRequest for ``prompt`` (a Prompt record, or a Response carrying its fields),
    its chat ``messages`` included (replacement rounds template the same chat)."""
    return {
        "prompt_id": prompt["prompt_id"], "domain": prompt["domain"], "mode": prompt.get("mode", "train"),
        "prompt": prompt["prompt"], "ground_truth": prompt.get("ground_truth", ""),
        "messages": list(prompt.get("messages") or []), "round": round_,
        "num_return_sequences": num_return_sequences, "sample_offset": sample_offset, "seed": seed,
        "created_ms": now_ms(),
    }


def replacement_request(response: Mapping, replacement: Replacement, seed: int) -> dict:
    return generation_request(
        response, round_=replacement.round, num_return_sequences=replacement.num_return_sequences,
        sample_offset=replacement.sample_offset, seed=seed,
    )


def group_record(
    *, prompt: Mapping, decided_accepted: bool, reason: str, values: Mapping[str, float],
    responses: Sequence[Mapping], filter_config: str, filter_config_hash: str, policy_version: int,
    rounds: int, responses_generated: int,
) -> dict:
    """A ``Group`` record: a decision-plane event. ``responses`` are RewardedResponse records
    (summaries naming their Response by a PayloadRef); no token arrays travel with a group. The
    prompt's text, ground truth and chat messages are carried once, here."""
    return {
        "group_key": prompt["prompt_id"], "kind": "rlvr", "prompt_id": prompt["prompt_id"],
        "domain": prompt["domain"], "mode": prompt.get("mode", "train"), "accepted": decided_accepted,
        "reason": reason, "decision_values": {k: float(v) for k, v in values.items()},
        "filter_config": filter_config, "filter_config_hash": filter_config_hash,
        "policy_version": policy_version, "rounds": rounds, "responses_generated": responses_generated,
        "prompt": prompt["prompt"], "ground_truth": prompt.get("ground_truth", ""),
        "messages": list(prompt.get("messages") or []), "responses": list(responses), "created_ms": now_ms(),
    }


def decided_group(response: Mapping, decided: Decided, responses: Sequence[Mapping],
                  filter_config: str, filter_config_hash: str) -> dict:
    """The Group record of a decided prompt; ``response`` is the ResponseSummary (or any record
    with the prompt's fields) of one of its responses."""
    return group_record(
        prompt=response, decided_accepted=decided.accepted, reason=decided.reason,
        values={**decided.values, **{f"rejected_responses/{k}": v for k, v in decided.rejected_responses.items()}},
        responses=responses, filter_config=filter_config, filter_config_hash=filter_config_hash,
        policy_version=decided.policy_version, rounds=decided.rounds,
        responses_generated=decided.responses_generated,
    )


def prompt_outcome(prompt: Mapping, *, committed: bool, reason: str, rounds: int, responses_generated: int,
                   policy_version: int = -1, rewards: Sequence[float] = ()) -> dict:
    """A ``PromptOutcome`` record; ``rewards``: the kept responses' response_level_rewards (their
    pattern is what the history-aware admission learns from)."""
    return {
        "prompt_id": prompt["prompt_id"], "domain": prompt["domain"], "mode": prompt.get("mode", "train"),
        "outcome": "commit" if committed else "abort", "reason": reason if not committed else ACCEPTED,
        "rounds": rounds, "responses_generated": responses_generated, "created_ms": now_ms(),
        "policy_version": policy_version if rewards else -1, "reward_pattern": reward_pattern(rewards),
    }


def derive_seed(run_seed: int, prompt_id: str, round_: int) -> int:
    """Deterministic sampling seed of one generation request."""
    return zlib.crc32(f"{run_seed}/{prompt_id}/{round_}".encode())
