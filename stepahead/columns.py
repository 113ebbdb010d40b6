"""Packed columns of the internal wire: one `bytes` field for a whole column of request ids or
small ints (the per-step columns of `RunningDeltas`, `StepResult` and `EventBatch`).

A `repeated` protobuf field costs one Python object conversion per element on both sides
(~30-70 ns each: at 256 running requests, most of a plan's, a result's and an event batch's
encoding time); these are a few C-level calls per column. Formats (scheduler.proto says the
same on each field):
- ids: the UTF-8 of each id followed by one NUL byte (ids never contain NUL: `limits.check_id`);
- uint32: little-endian, 4 bytes each;
- flags: one byte each, 0 or 1.
Every decoder is given network bytes: anything malformed raises ValueError naming the field.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

_U32 = "I" if array("I").itemsize == 4 else "L"
assert array(_U32).itemsize == 4, "no 4-byte unsigned array type"
_SWAP = sys.byteorder != "little"


def pack_ids(ids: Sequence[str]) -> bytes:
    if not ids:
        return b""
    joined = "\0".join(ids)
    if joined.count("\0") != len(ids) - 1:
        raise ValueError("an id contains a NUL character")
    return (joined + "\0").encode()


def unpack_ids(data: bytes, field: str) -> list[str]:
    if not data:
        return []
    try:
        ids = data.decode("utf-8").split("\0")
    except UnicodeDecodeError:
        raise ValueError(f"{field}: not UTF-8") from None
    if ids.pop() != "":
        raise ValueError(f"{field}: the last id is not NUL-terminated")
    return ids


def pack_u32(values: Sequence[int]) -> bytes:
    try:
        packed = array(_U32, values)
    except OverflowError:
        raise ValueError("a uint32 column holds a value outside [0, 2**32)") from None
    if _SWAP:
        packed.byteswap()
    return packed.tobytes()


def unpack_u32(data: bytes, field: str) -> list[int]:
    if len(data) % 4:
        raise ValueError(f"{field}: {len(data)} bytes is not a whole number of uint32")
    values = array(_U32)
    values.frombytes(data)
    if _SWAP:
        values.byteswap()
    return values.tolist()


def pack_flags(values: Sequence[bool]) -> bytes:
    return bytes(values)


def unpack_flags(data: bytes, field: str) -> list[bool]:
    if data.translate(None, b"\0\1"):
        raise ValueError(f"{field}: a flag byte other than 0 or 1")
    return list(map(bool, data))
