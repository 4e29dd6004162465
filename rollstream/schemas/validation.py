"""Consistency checks of decoded events beyond what Avro enforces (lengths that must agree,
finite numbers). Shared by the processors that accept an event and the trainer that uses it, so
an event the trainer would refuse is refused where it enters."""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np

from rollstream.schemas.packed import unpack_array
from rollstream.schemas.records import REWARD_PATTERNS


def check_trajectory(traj: dict, where: str = "") -> None:
    """Raise ``ValueError`` unless a decoded ``Trajectory`` record can be trained.

    Checks: ``turns[0].prompt_token_ids`` non-empty (when there are turns; a trajectory without
    turns is an all-padding placeholder), per turn as many ``infer_logprobs`` as
    ``response_token_ids``, a ``response_mask`` of 0/1 values exactly as long as the flattened
    response (``sum len(response_k) + sum_{k>=1} len(prompt_k)``), every ``extras`` array with
    that many entries along its first dimension, a finite ``response_level_rewards``. ``where``
    prefixes the message (default: the identity).

    The arrays may be the numpy views a decoded record holds (packed fields) or plain sequences
    (a record built in memory); the mask check is one vectorised pass either way.
    """
    where = where or (f"trajectory {traj.get('mode')}/{traj.get('group_id')}/{traj.get('episode_id')}/"
                      f"{traj.get('traj_index')}")
    turns = traj["turns"]
    if turns and not len(turns[0]["prompt_token_ids"]):
        raise ValueError(f"{where}: turns[0] has no prompt tokens")
    n_flat = 0
    for t, turn in enumerate(turns):
        n_tok, n_lp = len(turn["response_token_ids"]), len(turn["infer_logprobs"])
        if n_tok != n_lp:
            raise ValueError(f"{where} turn {t}: {n_tok} response tokens but {n_lp} infer_logprobs")
        n_flat += n_tok + (len(turn["prompt_token_ids"]) if t else 0)
    mask = traj["response_mask"]
    if len(mask) != n_flat:
        raise ValueError(f"{where}: response_mask has {len(mask)} entries but the flattened response "
                         f"has {n_flat} tokens")
    values = np.asarray(mask)
    if values.size and not (values.dtype == np.uint8 and int(values.max()) <= 1):
        bad = np.unique(values[(values != 0) & (values != 1)])
        if bad.size:
            raise ValueError(f"{where}: response_mask values must be 0 or 1, got {sorted(bad.tolist())}")
    check_extras(traj, n_flat, where)
    reward = traj["response_level_rewards"]
    if not math.isfinite(reward):
        raise ValueError(f"{where}: non-finite response_level_rewards {reward} "
                         "(such groups must be rejected upstream with reason invalid_reward)")


def check_extras(payload: Mapping, n_tokens: int, where: str) -> None:
    """Raise ``ValueError`` unless every ``extras`` entry of a payload (``Response``: along its
    response tokens; ``Trajectory``: along its flattened response) is a consistent ``PackedArray``
    (or array) whose first dimension is ``n_tokens``. ``where`` prefixes the message."""
    for name, packed in (payload.get("extras") or {}).items():
        try:
            array = unpack_array(packed) if isinstance(packed, Mapping) else np.asarray(packed)
        except ValueError as exc:
            raise ValueError(f"{where}: extras[{name!r}]: {exc}") from None
        if array.ndim < 1 or array.shape[0] != n_tokens:
            raise ValueError(f"{where}: extras[{name!r}] has shape {tuple(array.shape)}; its first dimension must "
                             f"be the {n_tokens} response tokens")


MODES = ("train", "val")
MAX_RETURN_SEQUENCES = 4096  # samples one GenerationRequest may ask for
MAX_ROUND = 100  # a prompt's generation rounds (max_response_rounds' bound)


def _identity(record: Mapping, where: str) -> list[str]:
    problems = []
    if not isinstance(record.get("prompt_id"), str) or not record["prompt_id"].strip():
        problems.append(f"{where}prompt_id must be a non-empty string")
    if "domain" in record and not str(record["domain"]).strip():
        problems.append(f"{where}domain must be a non-empty string")
    if record.get("mode", "train") not in MODES:
        problems.append(f"{where}mode must be one of {list(MODES)}, got {record.get('mode')!r}")
    return problems


def _at_least(record: Mapping, where: str, bounds: Mapping[str, int]) -> list[str]:
    return [f"{where}{name} must be >= {low}, got {record[name]}" for name, low in bounds.items()
            if name in record and record[name] < low]


def _finite(record: Mapping, where: str, *names: str) -> list[str]:
    return [f"{where}{name} must be a finite number >= 0, got {record[name]}" for name in names
            if name in record and not (math.isfinite(record[name]) and record[name] >= 0)]


def _check_prompt(r: Mapping) -> list[str]:
    return _identity(r, "")


def _check_request(r: Mapping) -> list[str]:
    problems = _identity(r, "") + _at_least(r, "", {"round": 0, "sample_offset": 0, "num_return_sequences": 1})
    if r["num_return_sequences"] > MAX_RETURN_SEQUENCES or r["round"] > MAX_ROUND:
        problems.append(f"num_return_sequences must be <= {MAX_RETURN_SEQUENCES} and round <= {MAX_ROUND}, got "
                        f"{r['num_return_sequences']} and {r['round']}")
    return problems


FINISH_REASONS = ("stop", "length", "error")  # rollstream.schemas.records.FINISH_*


def _check_summary(r: Mapping, where: str) -> list[str]:
    problems = _identity(r, where) + _at_least(r, where, {"round": 0, "sample_index": 0, "prompt_length": 0,
                                                           "response_length": 0})
    if r["finish_reason"] not in FINISH_REASONS:
        problems.append(f"{where}finish_reason must be one of {list(FINISH_REASONS)}, got {r['finish_reason']!r}")
    return problems + _finite(r, where, "generation_ms")


def _check_response(r: Mapping) -> list[str]:
    problems = _check_summary({**r, "prompt_length": 0, "response_length": 0}, "")
    n_tok, n_lp = len(r["response_token_ids"]), len(r["infer_logprobs"])
    if n_tok != n_lp:
        problems.append(f"{n_tok} response_token_ids but {n_lp} infer_logprobs")
    if not len(r["prompt_token_ids"]) and r["finish_reason"] != "error":
        problems.append("no prompt_token_ids")
    try:
        check_extras(r, n_tok, "extras")
    except ValueError as exc:
        problems.append(str(exc))
    return problems


def _check_rewarded(r: Mapping) -> list[str]:
    # a NaN / inf reward is not a malformed event: the response filter rejects it invalid_reward
    return _check_summary(r["response"], "response.") + _finite(r, "", "reward_ms")


def _check_outcome(r: Mapping) -> list[str]:
    problems = _identity(r, "") + _at_least(r, "", {"rounds": 0, "responses_generated": 0})
    if r["outcome"] not in ("commit", "abort"):
        problems.append(f"outcome must be commit or abort, got {r['outcome']!r}")
    if r.get("reward_pattern", "") not in ("", *REWARD_PATTERNS):
        problems.append(f"reward_pattern must be one of {list(REWARD_PATTERNS)} or empty, got {r['reward_pattern']!r}")
    return problems


def _check_command(r: Mapping) -> list[str]:
    if r["command"] == "tick":
        return []
    if r["command"] != "start":
        return [f"command must be start or tick, got {r['command']!r}"]
    return ([f"mode must be one of {list(MODES)}, got {r['mode']!r}"] if r["mode"] not in MODES else []) + _at_least(
        r, "", {"group_id": 0})


def _check_episode_request(r: Mapping) -> list[str]:
    problems = _at_least(r, "", {"group_id": 0, "episode_id": 0, "traj_index": 0, "max_actions_per_traj": 1,
                                 "max_tokens_per_step": 1})
    if r["mode"] not in MODES:
        problems.append(f"mode must be one of {list(MODES)}, got {r['mode']!r}")
    if not (math.isfinite(r["env_step_timeout_s"]) and r["env_step_timeout_s"] > 0):
        problems.append(f"env_step_timeout_s must be a finite number > 0, got {r['env_step_timeout_s']}")
    if not math.isfinite(r["format_penalty"]):
        problems.append(f"format_penalty must be finite, got {r['format_penalty']}")
    return problems


_CHECKS = {"Prompt": _check_prompt, "GenerationRequest": _check_request, "Response": _check_response,
           "RewardedResponse": _check_rewarded, "PromptOutcome": _check_outcome, "GroupCommand": _check_command,
           "EpisodeRequest": _check_episode_request}


def check_event(schema: str, record: Mapping) -> str | None:
    """What makes a decoded event of ``schema`` unusable though Avro accepted it, or None.

    Identities must be usable (a non-empty ``prompt_id``, ``mode`` train or val), counts and
    indices non-negative and in range, token arrays of one length, finish reasons and commands
    from their vocabularies, timings finite. Every stage refuses such an event where it enters
    (``invalid_event`` dead letter, rollstream.kafka.events.decode_expected). Trajectories are
    checked by ``check_trajectory`` at the group queue (set aside ``invalid_trajectory``), groups
    by the trainer. A NaN or infinite reward is not malformed: it is rejected ``invalid_reward``.
    """
    check = _CHECKS.get(schema)
    problems = check(record) if check is not None else []
    return "; ".join(problems) if problems else None
