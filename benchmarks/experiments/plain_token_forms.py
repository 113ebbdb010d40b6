"""Three forms of `EventBatch`'s plain decode tokens, side by side in one run: the two columns
as `bytes` fields (`stepahead.columns`: NUL-terminated UTF-8 ids, little-endian uint32
tokens; what the protocol uses), the same two columns as `repeated` fields (the previous
wire), and one nested message holding repeated columns (the last two built here with a
dynamic descriptor). Per batch of N plain tokens: encode + serialize, and parse + walk the
pairs as the gateway's reader does; min of 7 repeats.

    PYTHONPATH=. .venv/bin/python benchmarks/experiments/plain_token_forms.py [--tokens 256] \
        [--out benchmarks/results/plain_token_forms.json]
"""

from __future__ import annotations

import argparse
import json
import timeit
from pathlib import Path

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from stepahead import columns as packed
from stepahead.v1 import scheduler_pb2

STRING, UINT32, MESSAGE, REPEATED, OPTIONAL = 9, 13, 11, 3, 1  # FieldDescriptorProto enums


def batch_classes():
    """`Repeated { repeated string token_request_ids = 2; repeated uint32 token_ids = 3; }` and
    `Batch { PlainTokens plain = 2; }` with
    `PlainTokens { repeated string request_ids = 1; repeated uint32 token_ids = 2; }`."""
    f = descriptor_pb2.FileDescriptorProto(name="plain_token_forms.proto", package="forms", syntax="proto3")
    flat = f.message_type.add(name="Repeated")
    flat.field.add(name="token_request_ids", number=2, type=STRING, label=REPEATED)
    flat.field.add(name="token_ids", number=3, type=UINT32, label=REPEATED)
    plain = f.message_type.add(name="PlainTokens")
    plain.field.add(name="request_ids", number=1, type=STRING, label=REPEATED)
    plain.field.add(name="token_ids", number=2, type=UINT32, label=REPEATED)
    batch = f.message_type.add(name="Batch")
    batch.field.add(name="plain", number=2, type=MESSAGE, label=OPTIONAL, type_name=".forms.PlainTokens")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return (message_factory.GetMessageClass(pool.FindMessageTypeByName("forms.Repeated")),
            message_factory.GetMessageClass(pool.FindMessageTypeByName("forms.Batch")))


def measure(n: int) -> dict:
    repeated_cls, nested_cls = batch_classes()
    rids, tokens = [f"run{i}" for i in range(n)], list(range(1000, 1000 + n))

    def write_packed() -> bytes:
        msg = scheduler_pb2.EventBatch(token_request_ids=packed.pack_ids(rids), token_ids=packed.pack_u32(tokens))
        return msg.SerializeToString()

    def write_columns() -> bytes:
        msg = repeated_cls()
        msg.token_request_ids.extend(rids)
        msg.token_ids.extend(tokens)
        return msg.SerializeToString()

    def write_nested() -> bytes:
        msg = nested_cls()
        msg.plain.request_ids.extend(rids)
        msg.plain.token_ids.extend(tokens)
        return msg.SerializeToString()

    wire, columns, nested = write_packed(), write_columns(), write_nested()

    def read_packed() -> int:
        msg = scheduler_pb2.EventBatch.FromString(wire)
        ids = packed.unpack_ids(msg.token_request_ids, "token_request_ids")
        return sum(1 for _ in zip(ids, packed.unpack_u32(msg.token_ids, "token_ids")))

    def read_columns() -> int:
        msg = repeated_cls.FromString(columns)
        return sum(1 for _ in zip(msg.token_request_ids, msg.token_ids))

    def read_nested() -> int:
        plain = nested_cls.FromString(nested).plain
        return sum(1 for _ in zip(plain.request_ids, plain.token_ids))

    def us(fn) -> float:
        return round(min(timeit.repeat(fn, number=500, repeat=7)) / 500 * 1e6, 1)

    return {"tokens": n, "write_packed_us": us(write_packed), "write_columns_us": us(write_columns),
            "write_nested_us": us(write_nested), "read_packed_us": us(read_packed), "read_columns_us": us(read_columns),
            "read_nested_us": us(read_nested), "bytes_packed": len(wire), "bytes_columns": len(columns),
            "bytes_nested": len(nested)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    row = measure(args.tokens)
    print(json.dumps(row))
    if args.out:
        args.out.write_text(json.dumps(row, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
