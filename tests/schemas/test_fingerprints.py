"""Fingerprints follow the Avro specification whatever the nesting: the Parsing Canonical Form of
the self-contained schema (every named type in full at its first use). Checked against the
Python ``avro`` reference package here, and against Java in tests/interop."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import avro.schema
import pytest

from rollstream.schemas import REGISTRY, decode
from rollstream.schemas.codec import SchemaRegistry, fingerprint_of, self_contained

DATA = Path(__file__).parent / "data"
FILES = REGISTRY.files  # every current schema file and history version


def _without_logical_types(schema):
    """The Parsing Canonical Form drops every attribute but name/type/fields/symbols/items/values/
    size, and writes a primitive in its simple form (``"bytes"``), as fastavro and Java's
    SchemaNormalization do; the Python ``avro`` package keeps ``{"type": "bytes"}`` for a primitive
    that had a logicalType, so the packed fields' logical types are dropped before asking it."""
    if isinstance(schema, dict):
        if schema.get("type") in ("bytes", "int", "long", "string") and "logicalType" in schema:
            return schema["type"]
        return {k: _without_logical_types(v) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_without_logical_types(v) for v in schema]
    return schema


@pytest.mark.parametrize("file", FILES)
def test_fingerprint_matches_the_avro_reference_package(file):
    contained = REGISTRY.self_contained_file(file)
    reference = avro.schema.parse(json.dumps(_without_logical_types(contained))).fingerprint("CRC-64-AVRO")
    assert fingerprint_of(contained) == reference
    if "/" not in file:  # a current schema: what encode writes
        assert REGISTRY.fingerprint(contained["name"].rsplit(".", 1)[-1]) == reference


def test_the_group_fingerprint_java_computed_is_kept_by_its_history_version():
    # Group (before packed arrays) -> responses -> RewardedResponse -> response: Response, a named
    # type two levels down; SchemaNormalization.parsingFingerprint64 gave -6336813206491796241.
    # The current Group's fingerprint is checked by Java itself in tests/interop.
    old = fingerprint_of(REGISTRY.self_contained_file("history/group.v1.avsc"))
    assert int.from_bytes(old, "little", signed=True) == -6336813206491796241


def test_a_group_event_written_by_the_landed_main_still_decodes():
    fixture = json.loads((DATA / "group_landed_main.json").read_text())
    message = base64.b64decode(fixture["message_b64"])
    assert int.from_bytes(message[2:10], "little", signed=True) == -3148088734752699947 == fixture["fingerprint"]
    name, record = decode(message)
    assert name == "Group"
    old = fixture["record"]
    assert {k: v for k, v in record.items() if k != "responses"} == {
        **{k: v for k, v in old.items() if k not in ("responses", "prompt_token_ids")}, "messages": []}
    assert [r["response"]["sample_index"] for r in record["responses"]] == [1, 2]
    # upgraded to the current shape: a summary, the reward, and the Response itself as payload
    for new, was in zip(record["responses"], old["responses"]):
        payload = {k: v.tolist() if hasattr(v, "tolist") else v for k, v in new["payload"].items()}
        assert payload == {**was["response"], "extras": {}, "messages": [], "policy_versions": []}
        assert (new["response"]["response_length"], new["response_level_reward"], new["scores"]) == (
            2, was["response_level_reward"], was["scores"])


def _write(directory: Path, file: str, schema: dict) -> None:
    (directory / file).write_text(json.dumps(schema))


def test_named_types_of_other_files_at_any_depth_are_defined_once_in_full(tmp_path):
    ns = "t.ns"
    _write(tmp_path, "leaf.avsc", {"type": "record", "name": "Leaf", "namespace": ns,
                                   "fields": [{"name": "v", "type": "int"},
                                              {"name": "e", "type": {"type": "enum", "name": "E", "symbols": ["A"]}}]})
    _write(tmp_path, "mid.avsc", {"type": "record", "name": "Mid", "namespace": ns,
                                  "fields": [{"name": "leaf", "type": "Leaf"},
                                             {"name": "leaves", "type": {"type": "array", "items": "Leaf"}}]})
    _write(tmp_path, "top.avsc", {"type": "record", "name": "Top", "namespace": ns,
                                  "fields": [{"name": "mids", "type": {"type": "map", "values": "Mid"}},
                                             {"name": "maybe", "type": ["null", "Leaf"]},
                                             {"name": "e2", "type": "E"}]})
    registry = SchemaRegistry.from_directory(tmp_path)
    contained = registry.self_contained_file("top.avsc")
    text = json.dumps(contained)
    # each named type defined exactly once, where it is first used
    assert text.count('"name": "t.ns.Leaf"') == 1 and text.count('"name": "t.ns.Mid"') == 1
    assert text.count('"name": "t.ns.E"') == 1
    for file in ("leaf.avsc", "mid.avsc", "top.avsc"):
        reference = avro.schema.parse(json.dumps(registry.self_contained_file(file))).fingerprint("CRC-64-AVRO")
        assert registry.fingerprint(file.removesuffix(".avsc").capitalize()) == reference
    record = {"mids": {"k": {"leaf": {"v": 1, "e": "A"}, "leaves": [{"v": 2, "e": "A"}]}},
              "maybe": {"v": 3, "e": "A"}, "e2": "A"}
    assert registry.decode(registry.encode(record, "Top")) == ("Top", record)


def test_an_undefined_name_is_a_clear_error():
    with pytest.raises(Exception, match="t.ns.Nowhere"):
        self_contained({"type": "record", "name": "t.ns.R", "fields": [{"name": "x", "type": "t.ns.Nowhere"}]})
