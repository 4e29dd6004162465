"""Single-object encoding codec and the fingerprint -> schema registry.

Every event is ``C3 01`` + the 8-byte little-endian CRC-64-AVRO fingerprint of its writer
schema's Parsing Canonical Form + the Avro binary body (the Avro specification's single-object
encoding), so any Avro client that knows the ``*.avsc`` files of this package can read it. The
schemas name each other's types across files; a fingerprint is always taken over the
self-contained schema in which every named type is defined in full at its first use, as the
specification's canonical form (and Java's ``SchemaNormalization``) requires.

``history/<name>.v<N>.avsc`` holds older writer versions, each self-contained (decode only). An
event of an older version is read with the current schema when Avro resolution allows it; for the
versions an upgrade in ``rollstream.schemas.upgrades.UPGRADES`` covers (changes resolution cannot
express, e.g. arrays that became packed bytes) it is read with the newest version that upgrade
covers and then upgraded.
``history/legacy_fingerprints.json`` maps fingerprints rollstream once wrote by mistake to the
schema file they stand for. Per-token arrays are packed bytes (``rollstream.schemas.packed``).
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any, Callable

import fastavro
from fastavro.schema import fingerprint, parse_schema, to_parsing_canonical_form

import rollstream.schemas.packed  # noqa: F401  (registers the packed-<dtype> logical types)
from rollstream.exceptions import (
    DecodeError,
    EncodeError,
    SchemaNotFoundError,
    UnknownFingerprintError,
)
from rollstream.schemas.upgrades import UPGRADES

MAGIC = b"\xc3\x01"
HEADER_LEN = 10  # 2 magic bytes + 8-byte fingerprint
SCHEMA_DIR = Path(__file__).parent


LEGACY_FINGERPRINTS = "legacy_fingerprints.json"
_HISTORY_VERSION = re.compile(r"\.v(\d+)\.avsc$")
PRIMITIVES = frozenset({"null", "boolean", "int", "long", "float", "double", "bytes", "string"})


def fingerprint_of(schema: Any) -> bytes:
    """CRC-64-AVRO fingerprint (8 bytes, little-endian) of a schema's Parsing Canonical Form.

    ``schema`` must be self-contained (see ``self_contained``).
    """
    # fastavro returns the hex of the little-endian byte sequence, i.e. the wire bytes.
    return bytes.fromhex(fingerprint(to_parsing_canonical_form(schema), "CRC-64-AVRO"))


def self_contained(schema: Any, named: dict[str, Any] | None = None, defined: set[str] | None = None) -> Any:
    """``schema`` with every named type it uses, at any depth, defined in full at its first
    occurrence (depth first, in field order) and referred to by full name after that: the form
    the Parsing Canonical Form is defined on (Avro specification, "Parsing Canonical Form for
    Schemas"). ``named``: full name -> schema of the types defined elsewhere (fastavro's
    ``named_schemas``). Raises SchemaNotFoundError for a name nobody defines."""
    named = named or {}
    defined = set() if defined is None else defined
    if isinstance(schema, str):
        if schema in defined or schema in PRIMITIVES:
            return schema
        if schema not in named:
            raise SchemaNotFoundError(f"named type {schema!r} is defined nowhere")
        return self_contained(named[schema], named, defined)
    if isinstance(schema, list):
        return [self_contained(branch, named, defined) for branch in schema]
    schema = {k: v for k, v in schema.items() if not k.startswith("__")}  # fastavro's parse bookkeeping
    kind = schema["type"]
    if kind in ("record", "error", "enum", "fixed"):
        if schema["name"] in defined:
            return schema["name"]
        defined.add(schema["name"])
        if kind in ("record", "error"):
            return {**schema, "fields": [{**f, "type": self_contained(f["type"], named, defined)}
                                         for f in schema["fields"]]}
        return schema
    if kind == "array":
        return {**schema, "items": self_contained(schema["items"], named, defined)}
    if kind == "map":
        return {**schema, "values": self_contained(schema["values"], named, defined)}
    return schema



class SchemaRegistry:
    """Schemas by short name (``"Response"``) and by fingerprint.

    Several writer schemas may share one name (older versions kept for evolution); the reader
    schema for a name is the one loaded from this package's files.
    """

    def __init__(self) -> None:
        self._named: dict[str, Any] = {}  # fastavro named-schema store
        self._reader: dict[str, Any] = {}  # short name -> parsed reader schema
        self._by_fp: dict[bytes, tuple[str, Any]] = {}  # fingerprint -> (name, parsed writer)
        self._fp_of: dict[str, bytes] = {}  # short name -> fingerprint of the current schema
        self._by_file: dict[str, tuple[str, Any]] = {}  # file under the directory -> (name, parsed)
        self._contained: dict[str, Any] = {}  # file -> its self-contained schema
        # fingerprint -> (reader schema or None for the writer's own, upgrade or None): how an
        # older writer version is read (see the module doc)
        self._read_as: dict[bytes, tuple[Any, Callable[[dict], dict] | None]] = {}
        self._history: dict[str, list[tuple[int, bytes, Any]]] = {}  # name -> (version, fp, parsed)

    @classmethod
    def from_directory(cls, directory: Path = SCHEMA_DIR,
                       upgrades: dict[str, tuple[int, Callable[[dict], dict]]] | None = None) -> "SchemaRegistry":
        """Current schemas from ``directory/*.avsc``; older versions that producers may still
        write from ``directory/history/*.avsc`` (decode only, self-contained). ``upgrades``:
        schema name -> (last history version N it covers, conversion to the current shape of a
        record read with version N): versions <= N are read with N, then converted; later
        versions resolve to the current schema (default: none)."""
        registry = cls()
        pending = {p.name: json.loads(p.read_text()) for p in sorted(directory.glob("*.avsc"))}
        # Files reference each other's named types: parse until a pass makes no progress.
        while pending:
            progressed = False
            for fname, raw in list(pending.items()):
                try:
                    registry.add(raw, file=fname)
                except fastavro.schema.UnknownType:
                    continue
                del pending[fname]
                progressed = True
            if not progressed:
                raise SchemaNotFoundError(f"unresolvable named types in {sorted(pending)}")
        history = directory / "history"
        for path in sorted(history.glob("*.avsc")):
            registry.add(json.loads(path.read_text()), current=False, file=f"history/{path.name}")
        registry._plan_history(upgrades or {})
        legacy = history / LEGACY_FINGERPRINTS
        if legacy.exists():
            for fp, entry in json.loads(legacy.read_text()).items():
                registry.add_legacy_fingerprint(int(fp), entry["file"])
        return registry

    def _plan_history(self, upgrades: dict[str, tuple[int, Callable[[dict], dict]]]) -> None:
        for name, versions in self._history.items():
            versions.sort(key=lambda v: v[0])
            covered, upgrade = upgrades.get(name, (None, None))
            older = [parsed for version, _, parsed in versions if upgrade is not None and version <= covered]
            for version, fp, writer in versions:
                if upgrade is not None and version <= covered:
                    self._read_as[fp] = (None if writer is older[-1] else older[-1], upgrade)
                else:
                    self._read_as[fp] = (self._reader.get(name), None)

    def add(self, raw: dict, *, current: bool = True, file: str | None = None) -> str:
        """Register a schema (JSON mapping); returns its short name.

        ``current=False`` registers an older writer version: it decodes, but never encodes.
        ``file``: the schema's file under the schema directory, for ``self_contained_file``.
        """
        named = self._named if current else {}  # history files are self-contained
        parsed = parse_schema(raw, named_schemas=named)
        expanded = parse_schema(raw, named_schemas=dict(named), expand=True, _force=True)
        name = parsed["name"].rsplit(".", 1)[-1]
        contained = self_contained(parsed, named)
        fp = fingerprint_of(contained)
        self._by_fp[fp] = (name, expanded)
        if current:
            self._reader[name] = expanded
            self._fp_of[name] = fp
        if file is not None:
            self._by_file[file] = (name, expanded)
            self._contained[file] = contained
            version = _HISTORY_VERSION.search(file)
            if not current and version:
                self._history.setdefault(name, []).append((int(version.group(1)), fp, expanded))
        return name

    def add_legacy_fingerprint(self, fp: int, file: str) -> None:
        """Decode events whose header carries ``fp`` (a signed 64-bit int, as Java prints it) with
        the schema of ``file``: fingerprints written before they followed the specification.
        Raises SchemaNotFoundError for an unknown file."""
        if file not in self._by_file:
            raise SchemaNotFoundError(f"legacy fingerprint {fp} names unknown schema file {file!r}")
        legacy = fp.to_bytes(8, "little", signed=True)
        self._by_fp[legacy] = self._by_file[file]
        self._read_as[legacy] = self._read_as.get(fingerprint_of(self._contained[file]), (None, None))

    def self_contained_file(self, file: str) -> dict:
        """The self-contained schema of ``file`` (e.g. ``"group.avsc"``,
        ``"history/trajectory_group.v1.avsc"``): what its fingerprint is taken over, and what any
        Avro library can parse without the other files. Raises SchemaNotFoundError."""
        try:
            return self._contained[file]
        except KeyError:
            raise SchemaNotFoundError(f"no schema file {file!r}; known: {sorted(self._contained)}") from None

    @property
    def names(self) -> list[str]:
        return sorted(self._reader)

    @property
    def files(self) -> list[str]:
        """Every schema file registered from a directory, history versions included."""
        return sorted(self._contained)

    def schema(self, name: str) -> Any:
        try:
            return self._reader[name]
        except KeyError:
            raise SchemaNotFoundError(f"no schema named {name!r}; known: {self.names}") from None

    def fingerprint(self, name: str) -> bytes:
        self.schema(name)
        return self._fp_of[name]

    def encode(self, record: dict, name: str) -> bytes:
        """Encode ``record`` as a single object of schema ``name``.

        Raises EncodeError when the record does not match the schema.
        """
        schema = self.schema(name)
        buf = io.BytesIO()
        buf.write(MAGIC)
        buf.write(self._fp_of[name])
        try:
            fastavro.schemaless_writer(buf, schema, record)
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as exc:
            raise EncodeError(f"record does not match schema {name}: {exc}") from exc
        return buf.getvalue()

    def encode_with_tail_array(self, record: dict, name: str, items: list[bytes], item_name: str) -> bytes:
        """Encode ``record`` whose LAST field is an array of ``item_name`` records, taking the
        array's items as already encoded single objects (``items``) instead of re-encoding them.

        Avro writes an array as ``count, items..., 0``; an empty array is the single byte 0, so
        the record with that field empty ends in 0 and the items are spliced in before it. Items
        written with an older schema of ``item_name`` are re-encoded first. Raises EncodeError.
        """
        schema = self.schema(name)
        array_field = schema["fields"][-1]["name"]
        head = self.encode({**record, array_field: []}, name)
        if not items:
            return head
        want = self._fp_of[item_name]
        bodies = []
        for item in items:
            if item[2:HEADER_LEN] != want:
                item = self.encode(self.decode(item)[1], item_name)
            bodies.append(item[HEADER_LEN:])
        return head[:-1] + _zigzag_varint(len(bodies)) + b"".join(bodies) + b"\x00"

    def decode(self, data: bytes) -> tuple[str, dict]:
        """Decode single-object bytes into ``(schema_name, record)``.

        Raises DecodeError for bytes that are not single-object Avro or do not parse, and
        UnknownFingerprintError when the writer schema is unknown.
        """
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise DecodeError(f"expected bytes, got {type(data).__name__}")
        data = bytes(data)
        if len(data) < HEADER_LEN or data[:2] != MAGIC:
            raise DecodeError("not Avro single-object encoding (missing C3 01 marker)")
        fp = data[2:HEADER_LEN]
        try:
            name, writer = self._by_fp[fp]
        except KeyError:
            raise UnknownFingerprintError(
                f"unknown writer schema fingerprint 0x{int.from_bytes(fp, 'little'):016x}"
            ) from None
        reader, upgrade = self._read_as.get(fp, (self._reader[name], None))
        buf = io.BytesIO(data[HEADER_LEN:])
        try:
            record = fastavro.schemaless_reader(
                buf, writer, None if writer is reader else reader
            )
        except Exception as exc:  # fastavro raises many types on truncated/corrupt bodies
            raise DecodeError(f"corrupt {name} body: {type(exc).__name__}: {exc}") from exc
        if buf.tell() != len(data) - HEADER_LEN:
            raise DecodeError(f"corrupt {name} body: {len(data) - HEADER_LEN - buf.tell()} trailing bytes")
        if upgrade is not None:
            try:
                record = upgrade(record)
            except (KeyError, TypeError, ValueError) as exc:
                raise DecodeError(f"{name} of an older schema does not upgrade: {type(exc).__name__}: {exc}") from exc
        return name, record


def _zigzag_varint(n: int) -> bytes:
    """Avro long encoding (zig-zag, then base-128 varint)."""
    z = (n << 1) ^ (n >> 63)
    out = bytearray()
    while z & ~0x7F:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


REGISTRY = SchemaRegistry.from_directory(upgrades=UPGRADES)


def encode(record: dict, name: str) -> bytes:
    """Encode with the package registry; see SchemaRegistry.encode."""
    return REGISTRY.encode(record, name)


def decode(data: bytes) -> tuple[str, dict]:
    """Decode with the package registry; see SchemaRegistry.decode."""
    return REGISTRY.decode(data)
