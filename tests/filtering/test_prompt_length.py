"""The admission's prompt-length rule and the filter config a prompt_too_long Group carries."""

from __future__ import annotations

import hashlib
import json

from rollstream.filtering.admission import prompt_filter_config, prompt_length_decision
from rollstream.filtering.decision import Decision


def test_a_prompt_longer_than_the_limit_is_rejected_with_its_figures():
    assert prompt_length_decision(41, 40) == Decision(False, "prompt_too_long", {"prompt_tokens": 41.0, "prompt_length": 40.0})


def test_a_prompt_at_or_under_the_limit_is_admitted():
    assert prompt_length_decision(40, 40) is None
    assert prompt_length_decision(0, 40) is None


def test_the_values_are_floats_as_the_group_event_records_them():
    values = prompt_length_decision(1025, 1024).values
    assert all(type(v) is float for v in values.values())


def test_prompt_filter_config_is_the_json_of_the_limit_and_its_short_hash():
    text, digest = prompt_filter_config(40)
    assert text == '{"prompt_length": 40}' and json.loads(text) == {"prompt_length": 40}
    assert digest == hashlib.sha256(b'{"prompt_length": 40}').hexdigest()[:16] and len(digest) == 16
    assert prompt_filter_config(41)[1] != digest
