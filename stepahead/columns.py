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
from collections.abc import Mapping, Sequence

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


class SampledTokens(Mapping):
    """A result's sampled tokens as they came off the wire: `packed_ids` (the packed id
    column, unparsed) and `tokens` (one per id, in the worker's order). Read as a mapping
    request id -> token, it parses the ids and builds the dict once, on first use; a caller
    that knows the order it expects compares `packed_ids` with its own packed ids instead.
    A malformed or repeated id raises ValueError when the mapping is first used."""

    __slots__ = ("packed_ids", "tokens", "_map")

    def __init__(self, packed_ids: bytes, tokens: list[int], field: str) -> None:
        if packed_ids and not packed_ids.endswith(b"\0"):
            raise ValueError(f"{field}: the last id is not NUL-terminated")
        if packed_ids.count(b"\0") != len(tokens):
            raise ValueError(f"{field}: {len(tokens)} tokens for {packed_ids.count(0)} sampled_request_ids")
        self.packed_ids, self.tokens, self._map = packed_ids, tokens, None

    def _mapping(self) -> dict[str, int]:
        if self._map is None:
            ids = unpack_ids(self.packed_ids, "StepResult.sampled_request_ids")
            mapping = dict(zip(ids, self.tokens))
            if len(mapping) != len(ids):
                raise ValueError("StepResult.sampled_request_ids: a request id appears more than once")
            self._map = mapping
        return self._map

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, request_id: str) -> int:
        return self._mapping()[request_id]

    def __iter__(self):
        return iter(self._mapping())

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._mapping()

    def keys(self):
        return self._mapping().keys()

    def values(self):
        return self._mapping().values()

    def items(self):
        return self._mapping().items()

    def __repr__(self) -> str:
        return f"SampledTokens({self._mapping()!r})"
