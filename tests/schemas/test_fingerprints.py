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


@pytest.mark.parametrize("file", FILES)
def test_fingerprint_matches_the_avro_reference_package(file):
    contained = REGISTRY.self_contained_file(file)
    reference = avro.schema.parse(json.dumps(contained)).fingerprint("CRC-64-AVRO")
    assert fingerprint_of(contained) == reference
    if "/" not in file:  # a current schema: what encode writes
        assert REGISTRY.fingerprint(contained["name"].rsplit(".", 1)[-1]) == reference


def test_group_fingerprint_is_the_one_java_computes():
    # Group -> responses -> RewardedResponse -> response: Response, a named type of another file
    # two levels down; SchemaNormalization.parsingFingerprint64 gives -6336813206491796241.
    assert int.from_bytes(REGISTRY.fingerprint("Group"), "little", signed=True) == -6336813206491796241


def test_a_group_event_written_by_the_landed_main_still_decodes():
    fixture = json.loads((DATA / "group_landed_main.json").read_text())
    message = base64.b64decode(fixture["message_b64"])
    assert int.from_bytes(message[2:10], "little", signed=True) == -3148088734752699947 == fixture["fingerprint"]
    name, record = decode(message)
    assert name == "Group"
    assert record == fixture["record"]
    assert [r["response"]["sample_index"] for r in record["responses"]] == [1, 2]


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
