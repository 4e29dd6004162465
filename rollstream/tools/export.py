"""`rollstream export`: a run's decided train groups as a Parquet dataset, one row per response
(RLVR) or trajectory (agentic), for SFT, analysis or a Hugging Face ``datasets`` load.

Each row carries its group's decision (``decision``: accepted | rejected, ``reason``,
``filter_config_hash``), the group's identity and policy version, the prompt, the member's reward
and its tokens and texts, fetched from the payload topics by reference. A payload that cannot be
fetched (expired by retention) leaves the token columns null and says why in ``payload_error``.

Memory is bounded: records are read a page at a time (one payload fetch per page) and written as
row groups of at most ``ROW_GROUP_ROWS`` rows. The file is written under a temporary name and
renamed when complete, so a failed export leaves nothing half-written.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rollstream.exceptions import RollstreamError
from rollstream.kafka.cluster import Bootstrap
from rollstream.kafka.topics import Topics
from rollstream.tools.replay import Replayed, Selection, member_payload, replay

ROW_GROUP_ROWS = 1024

_DECISION = [("decision", pa.string()), ("reason", pa.string()), ("filter_config_hash", pa.string()),
             ("group_key", pa.string()), ("mode", pa.string()), ("policy_version", pa.int64())]
_TOKENS = pa.list_(pa.int32())
_LOGPROBS = pa.list_(pa.float32())

RESPONSE_SCHEMA = pa.schema(_DECISION + [
    ("prompt_id", pa.string()), ("domain", pa.string()), ("prompt", pa.string()), ("ground_truth", pa.string()),
    ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ("sample_index", pa.int32()), ("round", pa.int32()), ("reward", pa.float64()),
    ("finish_reason", pa.string()), ("response_policy_version", pa.int64()), ("response_text", pa.string()),
    ("prompt_token_ids", _TOKENS), ("response_token_ids", _TOKENS), ("infer_logprobs", _LOGPROBS),
    ("payload_error", pa.string()),
])
"""One row per response of an RLVR group (``Group`` events)."""

TRAJECTORY_SCHEMA = pa.schema(_DECISION + [
    ("group_id", pa.int64()), ("episode_id", pa.int64()), ("traj_index", pa.int32()), ("tag", pa.string()),
    ("env_type", pa.string()), ("seed", pa.int64()), ("reward", pa.float64()), ("step_rewards", pa.list_(pa.float64())),
    ("success", pa.bool_()), ("stop_reason", pa.string()), ("env_timeout", pa.bool_()), ("env_failed", pa.bool_()),
    ("drop_flag", pa.bool_()), ("trajectory_policy_version", pa.int64()), ("num_turns", pa.int32()),
    ("response_texts", pa.list_(pa.string())),
    ("turn_prompt_token_ids", pa.list_(_TOKENS)), ("turn_response_token_ids", pa.list_(_TOKENS)),
    ("turn_infer_logprobs", pa.list_(_LOGPROBS)), ("response_mask", pa.list_(pa.uint8())),
    ("payload_error", pa.string()),
])
"""One row per trajectory of an agentic group (``TrajectoryGroup`` events). Its prompt is the
chat-templated first observation, ``turn_prompt_token_ids[0]`` (later turns' prompt tokens are the
environment's answers); ``response_texts`` holds the model's text of each turn and
``response_mask`` marks the model's tokens over the flattened response, as the trainer reads it."""


@dataclass
class Exported:
    """What an export wrote: rows and groups per decision, and payloads it could not fetch."""

    path: Path
    rows: dict[str, int] = field(default_factory=lambda: {"accepted": 0, "rejected": 0})
    groups: dict[str, int] = field(default_factory=lambda: {"accepted": 0, "rejected": 0})
    payload_errors: int = 0


def _array(values) -> list:
    return np.asarray(values).tolist()


def _decision(group: dict, decision: str) -> dict:
    return {"decision": decision, "reason": group["reason"], "filter_config_hash": group.get("filter_config_hash"),
            "group_key": group["group_key"], "mode": group.get("mode"), "policy_version": group.get("policy_version")}


_RESPONSE_PAYLOAD = ("response_text", "prompt_token_ids", "response_token_ids", "infer_logprobs")
_TRAJECTORY_PAYLOAD = ("response_texts", "turn_prompt_token_ids", "turn_response_token_ids", "turn_infer_logprobs",
                       "response_mask")


def response_rows(replayed: Replayed, decision: str) -> Iterator[dict]:
    """The rows of one ``Group`` record (RESPONSE_SCHEMA), by sample index."""
    group = replayed.record.value
    head = {**_decision(group, decision), "prompt_id": group["prompt_id"], "domain": group["domain"],
            "prompt": group.get("prompt"), "ground_truth": group.get("ground_truth"),
            "messages": group.get("messages") or []}
    for member in sorted(group["responses"], key=lambda rr: rr["response"]["sample_index"]):
        summary = member["response"]
        found, error = member_payload(member, replayed.payloads)
        tokens = dict.fromkeys(_RESPONSE_PAYLOAD) if found is None else {
            "response_text": found.value.get("response_text"),
            **{name: _array(found.value[name]) for name in _RESPONSE_PAYLOAD[1:]}}
        yield {**head, "sample_index": summary["sample_index"], "round": summary.get("round"),
               "reward": member["response_level_reward"], "finish_reason": summary.get("finish_reason"),
               "response_policy_version": summary.get("policy_version"), **tokens, "payload_error": error}


def trajectory_rows(replayed: Replayed, decision: str) -> Iterator[dict]:
    """The rows of one ``TrajectoryGroup`` record (TRAJECTORY_SCHEMA), by trajectory index."""
    group = replayed.record.value
    head = _decision(group, decision)
    for traj in sorted(group["trajectories"], key=lambda t: t["traj_index"]):
        found, error = member_payload(traj, replayed.payloads)
        if found is None:
            tokens = dict.fromkeys(_TRAJECTORY_PAYLOAD)
        else:
            turns = found.value["turns"]
            tokens = {"response_texts": [t.get("response_text") for t in turns],
                      **{f"turn_{name}": [_array(t[name]) for t in turns]
                         for name in ("prompt_token_ids", "response_token_ids", "infer_logprobs")},
                      "response_mask": _array(found.value["response_mask"])}
        yield {**head, **{k: traj.get(k) for k in ("group_id", "episode_id", "traj_index", "tag", "env_type", "seed",
                                                    "success", "stop_reason", "env_timeout", "env_failed", "drop_flag",
                                                    "num_turns")},
               "reward": traj["response_level_rewards"], "step_rewards": list(traj.get("step_rewards") or []),
               "trajectory_policy_version": traj.get("policy_version"), **tokens, "payload_error": error}


def _decided_rows(bootstrap: Bootstrap, topic: str, decision: str, rows_of, result: Exported) -> Iterator[dict]:
    """The rows of every group on ``topic``, read a page at a time with its payloads; counts the
    groups in ``result``."""
    for replayed in replay(bootstrap, topic, Selection(), payloads=True, idle_timeout_s=30.0):
        if replayed.record.value is None:
            continue  # undecodable: not a group
        result.groups[decision] += 1
        yield from rows_of(replayed, decision)


def _chunks(rows: Iterable[dict], size: int) -> Iterator[list[dict]]:
    chunk: list[dict] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def export_run(bootstrap: Bootstrap, topics: Topics, out: Path, *, agentic: bool, rejected: bool = False,
               row_group_rows: int = ROW_GROUP_ROWS) -> Exported:
    """Write the train groups of the run under ``topics`` (``groups.accepted``; ``rejected``:
    ``groups.rejected`` too) to the Parquet file ``out``, one row per member (schema
    TRAJECTORY_SCHEMA when ``agentic``, else RESPONSE_SCHEMA). Raises RollstreamError when
    ``out`` cannot be written (nothing is left behind), TopicNotFound when the run has no
    ``groups.accepted``."""
    out = Path(out)
    partial = out.with_name(f".{out.name}.partial")
    schema, rows_of = (TRAJECTORY_SCHEMA, trajectory_rows) if agentic else (RESPONSE_SCHEMA, response_rows)
    result = Exported(out)
    try:
        writer = pq.ParquetWriter(partial, schema)
    except OSError as exc:
        raise RollstreamError(f"export: cannot write {out}: {exc.strerror or exc}") from exc
    try:
        sources = [("accepted", topics.groups_accepted)] + ([("rejected", topics.groups_rejected)] if rejected else [])
        for decision, topic in sources:
            for chunk in _chunks(_decided_rows(bootstrap, topic, decision, rows_of, result), row_group_rows):
                writer.write_table(pa.Table.from_pylist(chunk, schema=schema))
                result.rows[decision] += len(chunk)
                result.payload_errors += sum(row["payload_error"] is not None for row in chunk)
        writer.close()
        os.replace(partial, out)
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    return result
