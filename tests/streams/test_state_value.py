"""The aggregator's table value: PromptState + accepted response bytes (no broker)."""

from __future__ import annotations

from rollstream.filtering.prompt_state import DomainFilters, step
from rollstream.schemas import encode
from rollstream.streams.aggregation import pack_state, unpack_state
from tests.integration.harness import response


def test_state_value_round_trip_keeps_response_bytes_in_order():
    f = DomainFilters(num_return_sequences=3)
    state, stored = None, {}
    for i in (2, 0):
        rec = response("pS", i, reward=1.0)
        state, _ = step(state, rec, f)
        stored[str(i)] = encode(rec, "RewardedResponse")
    back_state, back_stored = unpack_state(pack_state(state, stored))
    assert back_state == state and back_stored == stored and list(back_stored) == ["2", "0"]
