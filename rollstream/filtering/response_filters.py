"""Response filters: one decision per rewarded response, before the group is complete.

The reference declares ``rewards.<domain>.response_filter_config`` but never reads it;
here it is wired. ``type: default`` applies these rules in order, each switchable in
``filter_args`` (all on by default except ``reject_invalid_format``):

=====================  ==============================================  ====================
rule                   rejects when                                    reason
=====================  ==============================================  ====================
reject_engine_error    finish_reason is ``error`` or ``abort``         engine_error
reject_empty           no response tokens, or only whitespace text     empty_response
                       (reward meta ``blank_text`` is ``true``)
reject_truncated       finish_reason is ``length`` (hit max tokens)    truncated
reject_invalid_reward  response_level_reward is NaN or +-inf           reward_failure
reject_invalid_format  reward meta ``invalid_format`` is ``true``       invalid_format
=====================  ==============================================  ====================

``reward_failure``: why the reward worker has no reward, from its meta ``reward_failure``:
``reward_timeout`` (the function outlived ``reward_timeout_s``), ``reward_error`` (it raised or
its process died), ``invalid_reward`` (NaN/inf or a non-number; also events without the key) or
``engine_error``.

``type: no_filter`` keeps everything. Any other type is an import path to a callable
``(rewarded_response: dict, filter_args) -> bool | Decision`` (True keeps).

A RewardedResponse carries the response's ``ResponseSummary`` (lengths, finish reason; no token
arrays, no text) and a PayloadRef: filters decide on ``response["response_length"]`` and the
reward worker's ``meta``, never on the tokens. Events written before references carry the
Response inline in ``payload`` (its text is read for ``reject_empty`` then).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

from rollstream.exceptions import ConfigError
from rollstream.filtering.decision import Decision
from rollstream.filtering.reasons import RejectReason
from rollstream.extensions import RESPONSE_FILTERS
from rollstream.filtering.registry import resolve_filter
from rollstream.schemas.records import FINISH_ERROR, FINISH_LENGTH

ResponseFilterFn = Callable[[Mapping[str, Any], Mapping[str, Any]], Decision]

BLANK_TEXT = "blank_text"
"""RewardedResponse ``meta`` key the reward worker sets: ``"true"`` when the response's text is
empty or whitespace only (the text itself is not in the decision-plane event)."""

REWARD_FAILURE = "reward_failure"
"""RewardedResponse ``meta`` key the reward worker sets when the reward is NaN: why, as a
rejection reason (``reward_timeout``, ``reward_error``, ``invalid_reward``, ``engine_error``)."""

_REWARD_FAILURES = {r.value: r for r in (RejectReason.REWARD_TIMEOUT, RejectReason.REWARD_ERROR,
                                         RejectReason.INVALID_REWARD, RejectReason.ENGINE_ERROR)}

DEFAULT_RULES = {
    "reject_engine_error": True,
    "reject_empty": True,
    "reject_truncated": True,
    "reject_invalid_reward": True,
    "reject_invalid_format": False,
}


_KEEP = Decision.accept()  # shared: a Decision is immutable by convention, its values are never changed


def keep_all(rewarded: Mapping[str, Any], filter_args: Mapping[str, Any]) -> Decision:
    return _KEEP


def default_response_filter(rewarded: Mapping[str, Any], filter_args: Mapping[str, Any]) -> Decision:
    rules = {**DEFAULT_RULES, **filter_args}
    response = rewarded["response"]
    finish = response.get("finish_reason", "")
    if rules["reject_engine_error"] and finish in (FINISH_ERROR, "abort"):
        return Decision.reject(RejectReason.ENGINE_ERROR)
    if rules["reject_empty"] and (not response.get("response_length") or _blank(rewarded)):
        return Decision.reject(RejectReason.EMPTY_RESPONSE)
    if rules["reject_truncated"] and finish == FINISH_LENGTH:
        return Decision.reject(RejectReason.TRUNCATED, response_tokens=float(response.get("response_length") or 0))
    reward = rewarded.get("response_level_reward")
    if rules["reject_invalid_reward"] and (reward is None or not math.isfinite(reward)):
        return Decision.reject(reward_failure(rewarded))
    if rules["reject_invalid_format"] and str(rewarded.get("meta", {}).get("invalid_format", "")).lower() == "true":
        return Decision.reject(RejectReason.INVALID_FORMAT)
    return _KEEP


def reward_failure(rewarded: Mapping[str, Any]) -> RejectReason:
    """Why a response has no finite reward: the reward worker's ``reward_failure``, else (older
    events, unknown values) ``invalid_reward``."""
    return _REWARD_FAILURES.get(str((rewarded.get("meta") or {}).get(REWARD_FAILURE, "")), RejectReason.INVALID_REWARD)


def _blank(rewarded: Mapping[str, Any]) -> bool:
    """The response text is empty or whitespace only: the reward worker's ``blank_text`` check,
    or the inline Response's text for events written before references."""
    if str((rewarded.get("meta") or {}).get(BLANK_TEXT, "")).lower() == "true":
        return True
    payload = rewarded.get("payload")
    return isinstance(payload, dict) and "response_text" in payload and not payload["response_text"].strip()


def resolve_response_filter(config: Mapping[str, Any]) -> ResponseFilterFn:
    """The filter a ``response_filter_config`` names. Raises UnknownFilterError."""
    name = config.get("type", "default")
    unknown = set(config.get("filter_args") or {}) - set(DEFAULT_RULES)
    if name == "default" and unknown:
        raise ConfigError(f"response_filter_config.filter_args: unknown rules {sorted(unknown)}; valid: {sorted(DEFAULT_RULES)}")
    return resolve_filter(RESPONSE_FILTERS, name)


def response_decider(config: Mapping[str, Any]) -> Callable[[Mapping[str, Any]], Decision]:
    """``decide_response`` with ``config`` resolved once: ``rewarded -> Decision`` (the aggregator
    calls it per response). Raises UnknownFilterError like resolve_response_filter."""
    fn = resolve_response_filter(config)
    filter_args = config.get("filter_args") or {}
    return lambda rewarded: fn(rewarded, filter_args)


def decide_response(rewarded: Mapping[str, Any], config: Mapping[str, Any]) -> Decision:
    """Decide one RewardedResponse record with the domain's ``response_filter_config``."""
    return resolve_response_filter(config)(rewarded, config.get("filter_args") or {})
