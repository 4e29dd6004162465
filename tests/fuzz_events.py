"""Malformed events, generated: for an input topic, from one good event of its schema, events of
every kind a stage must refuse (dead-letter with a reason) without dying.

Kinds: random bytes, truncated Avro, valid Avro of another schema, the topic's own fingerprint
with a garbage body, NaN / inf numbers, negative or inconsistent lengths and indices, huge
strings, unknown domains and modes, empty identities. Generation is seeded (``random.Random``),
so a failure replays exactly; ``malformed`` keeps only events that rollstream's own decoding
refuses (a random body that happens to decode into a valid record is not malformed).
"""

from __future__ import annotations

import copy
import math
import random
from typing import Callable, Mapping

from rollstream.kafka.events import decode_expected
from rollstream.schemas import encode
from rollstream.schemas.codec import HEADER_LEN

Mutation = Callable[[dict, random.Random], dict | None]


def _set(path: str, value) -> Mutation:
    """A record with the dotted ``path`` set to ``value`` (None when the record has no such field)."""
    keys = path.split(".")

    def mutate(record: dict, rng: random.Random) -> dict | None:
        out = node = copy.deepcopy(record)
        for key in keys[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if not isinstance(node, dict) or keys[-1] not in node:
            return None
        node[keys[-1]] = value(rng) if callable(value) else value
        return out
    return mutate


# Semantic mutations, applied where the schema has the field (dotted paths into the record).
MUTATIONS: dict[str, list[Mutation]] = {
    "nan_inf": [_set(p, v) for p in ("generation_ms", "reward_ms", "response.generation_ms", "env_step_timeout_s",
                                     "format_penalty") for v in (math.nan, math.inf, -math.inf)],
    "negative": [_set(p, lambda rng: -rng.randint(1, 10**6)) for p in (
        "round", "sample_index", "sample_offset", "num_return_sequences", "response.sample_index", "response.round",
        "response.response_length", "group_id", "episode_id", "traj_index", "max_tokens_per_step", "rounds")],
    "out_of_range": [_set("num_return_sequences", 10**6), _set("num_return_sequences", 0), _set("round", 10**6),
                     _set("max_actions_per_traj", 0)],
    "inconsistent": [_set("infer_logprobs", lambda rng: [-0.5] * rng.randint(7, 20)),
                     _set("extras", {"routed_experts": {"dtype": "uint8", "shape": [999, 2], "data": b"\x01\x02"}})],
    "huge_string": [_set(p, lambda rng: "x" * rng.randint(200_000, 400_000)) for p in ("domain", "response.domain")],
    "unknown_domain": [_set(p, "no-such-domain") for p in ("domain", "response.domain")],
    "unknown_mode": [_set(p, lambda rng: rng.choice(["test", "", "TRAIN", "eval"])) for p in ("mode", "response.mode")],
    "empty_id": [_set(p, "") for p in ("prompt_id", "response.prompt_id")],
    "vocabulary": [_set("finish_reason", "exploded"), _set("response.finish_reason", "maybe"),
                   _set("outcome", "perhaps"), _set("command", "explode")],
}


def malformed(schema: str, good: Mapping, others: Mapping[str, Mapping], count: int, seed: int,
              expected: tuple[str, ...] | None = None, domains: set[str] | None = None) -> list[tuple[str, bytes]]:
    """``count`` (kind, bytes) events for a topic that expects ``expected`` (default: ``schema``),
    derived from ``good`` (a valid ``schema`` record) and ``others`` (valid records of other
    schemas, by name). Every event returned is refused by ``decode_expected``, or (``domains``:
    the configured reward domains, for stages that check them) names another domain."""
    rng = random.Random(seed)
    expected = expected or (schema,)
    good_bytes = encode(dict(good), schema)  # starts with the marker and schema's fingerprint
    semantic = [(kind, m) for kind, ms in MUTATIONS.items() for m in ms if m(dict(good), rng) is not None]
    makers: list[tuple[str, Callable[[], bytes]]] = [
        ("random_bytes", lambda: rng.randbytes(rng.randint(0, 300))),
        ("truncated", lambda: good_bytes[:rng.randint(0, len(good_bytes) - 1)]),
        ("garbage_body", lambda: good_bytes[:HEADER_LEN] + b"\xff" * rng.randint(1, 64)),  # never a valid varint
        ("other_schema", lambda: encode(dict(others[name := rng.choice(sorted(others))]), name)),
        *[(kind, (lambda m=m: encode(m(dict(good), rng), schema))) for kind, m in semantic],
    ]
    out: list[tuple[str, bytes]] = []
    attempts = 0
    while len(out) < count:
        attempts += 1
        if attempts > count * 20:
            raise RuntimeError(f"could not make {count} malformed {schema} events")
        kind, make = rng.choice(makers)
        try:
            value = make()
        except Exception:  # a mutation the schema itself refuses (e.g. a wrong type): not an event
            continue
        _, record, problem = decode_expected(value, expected)
        if problem is not None or (domains is not None and _domain(record) not in domains):
            out.append((kind, value))
    return out


def interleave(good: list, bad: list, seed: int) -> list:
    """``good`` and ``bad`` merged at random positions, each list's own order kept."""
    rng = random.Random(seed)
    out, g, b = [], list(good), list(bad)
    while g or b:
        take_good = g and (not b or rng.random() < len(g) / (len(g) + len(b)))
        out.append(g.pop(0) if take_good else b.pop(0))
    return out



def _domain(record: Mapping) -> str | None:
    return record.get("domain", (record.get("response") or {}).get("domain"))
