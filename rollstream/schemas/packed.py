"""Per-token arrays as Avro ``bytes`` of little-endian fixed-width values.

A schema field ``{"type": "bytes", "logicalType": "packed-int32"}`` holds int32 values (likewise
``packed-float32``, ``packed-uint8`` ...). fastavro's custom logical types do the conversion: a
writer takes bytes, a numpy array or any sequence of numbers; a reader gets a read-only numpy view
over the decoded bytes (no per-element decoding). Other Avro clients ignore the unknown logical
type and read plain bytes; the dtype is named in each field's doc.

Optional arrays without a field of their own (``extras``, e.g. ``routed_experts``) travel as
``PackedArray`` records: dtype, shape, data.
"""

from __future__ import annotations

from typing import Any, Mapping

import fastavro.read
import fastavro.write
import numpy as np

DTYPES = ("uint8", "uint16", "int32", "int64", "float16", "float32", "float64")
"""The dtypes a packed field or a PackedArray may hold (always little-endian)."""


def to_bytes(values: Any, dtype: str) -> bytes:
    """``values`` (bytes, numpy array or sequence of numbers) as little-endian ``dtype`` bytes.

    Bytes pass through unchanged (they are taken to be packed already). Integers are never
    wrapped or truncated silently: OverflowError for a value outside the dtype's range, ValueError
    for non-integral values into an integer dtype or a dtype outside ``DTYPES``."""
    if isinstance(values, (bytes, bytearray, memoryview)):
        return bytes(values)
    if dtype not in DTYPES:
        raise ValueError(f"unknown packed dtype {dtype!r}; valid: {DTYPES}")
    target = np.dtype(dtype).newbyteorder("<")
    array = np.asarray(values)
    if array.dtype != target and target.kind in "iu" and array.size:
        if array.dtype.kind not in "iub":
            raise ValueError(f"cannot pack {array.dtype} values as {dtype}")
        info = np.iinfo(target)
        if array.min() < info.min or array.max() > info.max:
            raise OverflowError(f"values outside the {dtype} range [{info.min}, {info.max}]")
    return array.astype(target, copy=False).tobytes()


def view(data: bytes, dtype: str) -> np.ndarray:
    """A read-only 1-D numpy view of packed little-endian ``dtype`` bytes (no copy).

    Raises ValueError when the length is not a multiple of the item size."""
    return np.frombuffer(data, dtype=np.dtype(dtype).newbyteorder("<"))


def packed_array(values: Any, dtype: str | None = None) -> dict:
    """A ``PackedArray`` record of ``values`` (any array-like; ``dtype`` default: its own, which
    must be one of ``DTYPES``). Raises ValueError for another dtype."""
    array = np.asarray(values, dtype=dtype)
    name = array.dtype.name
    if name not in DTYPES:
        raise ValueError(f"PackedArray dtype must be one of {DTYPES}, got {name}")
    return {"dtype": name, "shape": list(array.shape), "data": to_bytes(array, name)}


def unpack_array(record: Mapping[str, Any]) -> np.ndarray:
    """The numpy array (read-only view, shape restored) of a decoded ``PackedArray`` record.

    Raises ValueError when dtype, shape and data disagree."""
    if record["dtype"] not in DTYPES:
        raise ValueError(f"PackedArray dtype must be one of {DTYPES}, got {record['dtype']!r}")
    flat = view(record["data"], record["dtype"])
    shape = tuple(int(d) for d in record["shape"])
    if int(np.prod(shape, dtype=np.int64)) != flat.size:
        raise ValueError(f"PackedArray of shape {shape} has {flat.size} {record['dtype']} values")
    return flat.reshape(shape)


def _register() -> None:
    """Teach fastavro the ``packed-<dtype>`` logical types of ``bytes`` (both its pure-Python and
    its compiled reader/writer consult these tables)."""
    for dtype in DTYPES:
        key = f"bytes-packed-{dtype}"
        fastavro.write.LOGICAL_WRITERS[key] = lambda datum, *_, _d=dtype: to_bytes(datum, _d)
        fastavro.read.LOGICAL_READERS[key] = lambda datum, *_, _d=dtype: view(datum, _d)


_register()
