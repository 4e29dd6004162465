"""Response filter rules, one case each, in their documented order."""

from __future__ import annotations

import math

import pytest

from rollstream.filtering import decide_response


def rr(finish="stop", tokens=3, text="42", reward=1.0, invalid_format=False):
    """A RewardedResponse as the reward worker writes it: the summary (lengths, no tokens or text),
    the text's checks in ``meta`` and a PayloadRef."""
    return {"response": {"finish_reason": finish, "prompt_length": 5, "response_length": tokens},
            "response_level_reward": reward,
            "meta": {"invalid_format": str(invalid_format).lower(), "extracted_answer": text.strip(),
                     "blank_text": "false" if text.strip() else "true"},
            "payload": {"topic": "rollstream.responses", "partition": 0, "offset": 7, "size_bytes": 99}}


DEFAULT = {"type": "default"}


@pytest.mark.parametrize("record, reason", [
    (rr(finish="error", tokens=0, text=""), "engine_error"),
    (rr(finish="abort"), "engine_error"),
    (rr(tokens=0, text=""), "empty_response"),
    (rr(text="   \n"), "empty_response"),
    (rr(finish="length"), "truncated"),
    (rr(reward=math.nan), "invalid_reward"),
    (rr(reward=math.inf), "invalid_reward"),
    (rr(reward=None), "invalid_reward"),
])
def test_default_rules_reject_with_reason(record, reason):
    d = decide_response(record, DEFAULT)
    assert (d.keep, d.reason) == (False, reason)


def test_events_before_references_are_judged_by_their_inline_response():
    # read through schema history: no blank_text check in meta, the Response itself in payload
    old = rr(text="   \n")
    old["meta"] = {"invalid_format": "false"}
    old["payload"] = {"prompt_token_ids": [1], "response_token_ids": [4, 5, 6], "response_text": "   \n"}
    assert decide_response(old, DEFAULT).reason == "empty_response"
    old["payload"]["response_text"] = "42"
    assert decide_response(old, DEFAULT).keep is True


def test_good_response_is_kept_and_invalid_format_is_off_by_default():
    assert decide_response(rr(invalid_format=True), DEFAULT).keep is True
    d = decide_response(rr(invalid_format=True), {"type": "default", "filter_args": {"reject_invalid_format": True}})
    assert (d.keep, d.reason) == (False, "invalid_format")


def test_each_rule_can_be_switched_off():
    off = {"type": "default", "filter_args": {"reject_truncated": False, "reject_invalid_reward": False}}
    assert decide_response(rr(finish="length"), off).keep is True
    assert decide_response(rr(reward=math.nan), off).keep is True


def test_truncation_reports_the_token_count():
    assert decide_response(rr(finish="length", tokens=48), DEFAULT).values == {"response_tokens": 48.0}


def test_custom_response_filter_by_import_path():
    cfg = {"type": f"{__name__}:short_only", "filter_args": {"max_chars": 3}}
    assert decide_response(rr(text="42"), cfg).keep is True
    d = decide_response(rr(text="forty-two"), cfg)
    assert (d.keep, d.reason) == (False, "custom_response_filter")


def short_only(rewarded, filter_args):
    return len(rewarded["meta"]["extracted_answer"]) <= filter_args["max_chars"]
