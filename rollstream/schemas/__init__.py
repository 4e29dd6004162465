"""Avro events in single-object encoding.

Wire format (Avro spec, "Single object encoding"): ``C3 01`` + the 8-byte little-endian
CRC-64-AVRO fingerprint of the writer schema's Parsing Canonical Form + the Avro binary body.
The fingerprint -> schema map is built from the ``*.avsc`` files beside this module, so no
registry server is needed. A reader decodes with its own (newest) schema of the same name, so a
writer schema that evolved by adding a field with a default still decodes (fastavro resolution).
When a schema changes, keep its previous version under ``history/`` (e.g.
``history/prompt.v1.avsc``, self-contained) so events written by not-yet-upgraded producers keep
decoding; a change Avro resolution cannot express also gets an upgrade in ``upgrades.py``.
Per-token arrays are packed little-endian ``bytes`` read as numpy views (``packed.py``).

Public API::

    encode(record, "Response") -> bytes
    decode(data) -> (schema_name, record)
"""

from rollstream.schemas.codec import (
    REGISTRY,
    SchemaRegistry,
    decode,
    encode,
    fingerprint_of,
)

__all__ = ["REGISTRY", "SchemaRegistry", "decode", "encode", "fingerprint_of"]
