"""Any Avro client reads rollstream's events: the Avro reference implementation (Java), given only
the schema files, decodes one event of every current schema (written by rollstream's encoder) and
every history version (rollstream only decodes those: written here with its fingerprint
function), a spliced Group, and a Group event the landed main wrote with the legacy fingerprint;
the values it decoded are those encoded: Java encodes them again to exactly the same body. New
``.avsc`` files are picked up by themselves.

Needs a JDK and Maven (as the broker does); the Avro jars are resolved once into
``~/.cache/rollstream/avro-java``.
"""

from __future__ import annotations

import base64
import io
import json
import subprocess
from pathlib import Path

import fastavro
import pytest
from fastavro import parse_schema

from rollstream.kafka.jars import java, resolve_jars
from rollstream.schemas import REGISTRY
from rollstream.schemas.codec import HEADER_LEN, MAGIC, SCHEMA_DIR, fingerprint_of

pytestmark = pytest.mark.interop

HERE = Path(__file__).parent
AVRO_VERSION = "1.12.2"


def sample(schema, named: dict, path: str = "x"):
    """A deterministic value of every Avro type in ``schema`` (a fastavro-parsed schema), varied
    by its path so that no two fields carry the same value."""
    if isinstance(schema, str):
        if schema in named:
            return sample(named[schema], named, path)
        seed = sum(map(ord, path))
        return {
            "null": None, "boolean": seed % 2 == 0, "int": seed % 1000 - 300, "long": seed * 10_000_019,
            "float": (seed % 64) / 8.0, "double": seed / 1024.0, "bytes": bytes([seed % 256, 0, 255]),
            "string": f"{path}-é",
        }[schema]
    if isinstance(schema, list):  # a union: its last branch, so optional fields carry a value
        return sample(schema[-1], named, path)
    kind = schema["type"]
    if kind == "record":
        named[schema["name"]] = schema
        return {f["name"]: sample(f["type"], named, f"{path}.{f['name']}") for f in schema["fields"]}
    if kind == "enum":
        named[schema["name"]] = schema
        return schema["symbols"][-1]
    if kind == "fixed":
        named[schema["name"]] = schema
        return bytes(range(schema["size"]))
    if kind == "array":
        return [sample(schema["items"], named, f"{path}[{i}]") for i in range(2)]
    if kind == "map":  # one entry: Java's HashMap may write several in another (valid) order
        return {"k0": sample(schema["values"], named, f"{path}{{0}}")}
    return sample(kind, named, path)


def single_object(schema_json: dict, record: dict) -> bytes:
    """``record`` written as a single object of ``schema_json`` (self-contained)."""
    parsed = parse_schema(schema_json, _force=True)
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, parsed, record)
    return MAGIC + fingerprint_of(schema_json) + buf.getvalue()


def cases() -> list[dict]:
    """One event per current schema file and per history version, plus a spliced Group."""
    out = []
    for path in sorted(SCHEMA_DIR.glob("*.avsc")) + sorted((SCHEMA_DIR / "history").glob("*.avsc")):
        file = path.relative_to(SCHEMA_DIR).as_posix()
        schema = REGISTRY.self_contained_file(file)
        record = sample(parse_schema(schema, _force=True), {})
        current = "/" not in file
        message = REGISTRY.encode(record, schema["name"].rsplit(".", 1)[-1]) if current else single_object(schema, record)
        out.append({"file": file, "message": message})
    rewarded = parse_schema(REGISTRY.self_contained_file("rewarded_response.avsc"), _force=True)
    group = sample(parse_schema(REGISTRY.self_contained_file("group.avsc"), _force=True), {})
    members = [REGISTRY.encode(sample(rewarded, {}, f"member{i}"), "RewardedResponse") for i in range(3)]
    out.append({"file": "group.avsc", "splice": True,
                "message": REGISTRY.encode_with_tail_array(group, "Group", members, "RewardedResponse")})
    landed = json.loads((HERE.parent / "schemas" / "data" / "group_landed_main.json").read_text())
    out.append({"file": "history/group.v1.avsc", "legacy": True, "message": base64.b64decode(landed["message_b64"])})
    return out


@pytest.fixture(scope="module")
def avro_jars() -> Path:
    return resolve_jars(HERE / "pom.xml", f"avro-java/{AVRO_VERSION}", {"avro.version": AVRO_VERSION},
                        marker="avro-*.jar")


def test_every_schema_and_history_version_decodes_in_java(avro_jars, tmp_path):
    written = cases()
    assert {c["file"] for c in written} >= {p.name for p in SCHEMA_DIR.glob("*.avsc")}
    lines = tmp_path / "cases.jsonl"
    lines.write_text("".join(json.dumps({"file": c["file"], "message": base64.b64encode(c["message"]).decode()})
                             + "\n" for c in written))
    proc = subprocess.run([java(), "-cp", f"{avro_jars}/*", str(HERE / "AvroDecode.java"), str(SCHEMA_DIR),
                           str(lines)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(results) == len(written)
    failures = [r for r in results if "error" in r]
    assert failures == []
    for case, result in zip(written, results):
        java_fp = int(result["fingerprint"]).to_bytes(8, "little", signed=True)
        reencoded = base64.b64decode(result["reencoded"])
        assert reencoded[HEADER_LEN:] == case["message"][HEADER_LEN:], case["file"]
        # Java writes the specification's fingerprint: ours, except on the legacy event
        assert reencoded[2:HEADER_LEN] == java_fp
        assert (java_fp == case["message"][2:HEADER_LEN]) is not case.get("legacy", False), case["file"]
        name = json.loads((SCHEMA_DIR / case["file"]).read_text())["name"]
        assert result["full_name"].rsplit(".", 1)[-1] == name.rsplit(".", 1)[-1]
    assert sum(c.get("splice", False) for c in written) == sum(c.get("legacy", False) for c in written) == 1


