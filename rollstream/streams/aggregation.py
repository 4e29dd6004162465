"""What the aggregator does with one rewarded response, without faust: table value in, table
value and events out. The faust agent, the benchmark and replay tools call the same code.

A table value is the PromptState (JSON) followed by the accepted responses' original bytes, so
one changelog record per response carries everything needed to rebuild the group after a
restart, and the emitted Group splices those bytes in without decoding them again.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

from rollstream.config import RLVRConfig
from rollstream.filtering.prompt_state import (
    Decided,
    DuplicateResponse,
    PromptState,
    Replacement,
    ResponseAccepted,
    ResponseRejected,
    step,
)
from rollstream.kafka.events import Send
from rollstream.kafka.topics import Topics
from rollstream.schemas import REGISTRY, encode
from rollstream.streams.events import decided_group, derive_seed, prompt_outcome, replacement_request

_U32 = struct.Struct("<I")


def pack_state(state: PromptState, responses: dict[str, bytes]) -> bytes:
    """u32 length + state JSON, then per accepted response u32 length + bytes, in the order of
    ``state.accepted``."""
    header = json.dumps(state.to_dict()).encode()
    parts = [_U32.pack(len(header)), header]
    for index in state.accepted:
        parts += [_U32.pack(len(responses[index])), responses[index]]
    return b"".join(parts)


def unpack_state(value: bytes) -> tuple[PromptState, dict[str, bytes]]:
    (n,) = _U32.unpack_from(value, 0)
    state = PromptState.from_dict(json.loads(value[4:4 + n]))
    responses, pos = {}, 4 + n
    for index in state.accepted:
        (size,) = _U32.unpack_from(value, pos)
        responses[index] = value[pos + 4:pos + 4 + size]
        pos += 4 + size
    return state, responses


@dataclass
class Applied:
    value: bytes | None  # the new table value; None when the state did not change
    sends: list[Send] = field(default_factory=list)
    decided: Decided | None = None
    duplicates: int = 0
    effects: list = field(default_factory=list)  # the state machine's effects, for metrics


class Aggregation:
    """The per-prompt transaction of one config, over encoded table values and events."""

    def __init__(self, config: RLVRConfig) -> None:
        self.topics = Topics(config.kafka.topic_prefix)
        self.seed = config.seed
        self.filters = config.domain_filters()
        self.filter_json = {d: config.filter_config_json(d) for d in self.filters}
        self.filter_hash = {d: config.filter_config_hash(d) for d in self.filters}

    def apply(self, table_value: bytes | None, event_value: bytes, record: dict,
              current_version: int | None = None) -> Applied:
        """One decoded RewardedResponse ``record`` (``event_value`` its bytes) against the prompt's
        table value; ``current_version``: the newest published policy version, for the staleness
        bound. The caller checked that the record's domain is configured."""
        response = record["response"]
        pid = response["prompt_id"]
        state, stored = unpack_state(table_value) if table_value else (None, {})
        state, effects = step(state, record, self.filters[response["domain"]], current_version)
        out = Applied(value=None, effects=effects)
        changed = False
        for effect in effects:
            if isinstance(effect, ResponseAccepted):
                stored[str(effect.sample_index)] = event_value
                changed = True
            elif isinstance(effect, ResponseRejected):
                changed = True  # its counters live in the state
            elif isinstance(effect, DuplicateResponse):
                out.duplicates += 1
            elif isinstance(effect, Replacement):
                request = replacement_request(response, effect, derive_seed(self.seed, pid, effect.round))
                out.sends.append(Send(self.topics.generation_requests, pid, encode(request, "GenerationRequest")))
            elif isinstance(effect, Decided):
                out.decided = effect
                out.sends += self._decision(response, effect, stored)
        if changed:
            out.value = pack_state(state, stored)
        return out

    def _decision(self, response: dict, decided: Decided, stored: dict[str, bytes]) -> list[Send]:
        pid, domain = response["prompt_id"], response["domain"]
        group = decided_group(response, decided, [], self.filter_json[domain], self.filter_hash[domain])
        value = REGISTRY.encode_with_tail_array(
            group, "Group", [stored[str(i)] for i in decided.sample_indices], "RewardedResponse")
        topic = self.topics.decision_topic(response.get("mode", "train"), decided.accepted)
        outcome = prompt_outcome(response, committed=decided.accepted, reason=decided.reason,
                                 rounds=decided.rounds, responses_generated=decided.responses_generated)
        return [Send(topic, pid, value), Send(self.topics.prompt_outcomes, pid, encode(outcome, "PromptOutcome"))]
