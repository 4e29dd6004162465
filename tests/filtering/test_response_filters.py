"""Response filter rules, one case each, in their documented order."""

from __future__ import annotations

import math

import pytest

from rollstream.filtering import decide_response


def rr(finish="stop", tokens=3, text="42", reward=1.0, invalid_format=False):
    return {"response": {"finish_reason": finish, "response_token_ids": list(range(tokens)), "response_text": text},
            "response_level_reward": reward, "meta": {"invalid_format": str(invalid_format).lower()}}


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
    return len(rewarded["response"]["response_text"]) <= filter_args["max_chars"]
