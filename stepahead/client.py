"""`stepahead generate`: stream one completion from a gateway to stdout.

    stepahead generate --target 127.0.0.1:50050 --max-tokens 32 "def fibonacci(n):"
    stepahead generate --json --temperature 0 "import os"   # one JSON object per message
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="prompt text")
    parser.add_argument("--target", default="127.0.0.1:50050", help="gateway address")
    parser.add_argument("--model", default="", help="served model name (default: the only one)")
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--min-tokens", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--stop-token-ids", type=int, nargs="*", default=[])
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--include-stop-str-in-output", action="store_true")
    parser.add_argument("--priority", type=int, default=0)
    parser.add_argument("--request-id", default="")
    parser.add_argument("--json", action="store_true", help="print each streamed message as JSON")


def build_request(args: argparse.Namespace):
    from stepahead.v1 import common_pb2, generation_pb2

    sampling = common_pb2.SamplingParams(
        top_k=args.top_k, min_p=args.min_p, min_tokens=args.min_tokens,
        stop_token_ids=args.stop_token_ids, ignore_eos=args.ignore_eos,
    )
    for name in ("temperature", "top_p", "seed", "max_tokens"):
        value = getattr(args, name)
        if value is not None:
            setattr(sampling, name, value)
    return generation_pb2.GenerateRequest(
        request_id=args.request_id, model=args.model, text=args.prompt, sampling=sampling,
        stop=args.stop, include_stop_str_in_output=args.include_stop_str_in_output, priority=args.priority,
    )


def run(args: argparse.Namespace) -> int:
    """Exit 0 only when the stream ended with a final message that finished normally
    (STOP or LENGTH); otherwise print why to stderr and exit 1."""
    import grpc
    from google.protobuf import json_format

    from stepahead import security
    from stepahead.v1 import common_pb2, generation_pb2_grpc

    last = None
    with security.channel(args.target, api_key=os.environ.get("STEPAHEAD_API_KEY")) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        try:
            for msg in stub.Generate(build_request(args)):
                last = msg
                if args.json:
                    print(json.dumps(json_format.MessageToDict(msg, preserving_proto_field_name=True)), flush=True)
                else:
                    sys.stdout.write(msg.text)
                    sys.stdout.flush()
        except grpc.RpcError as exc:
            print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    if not args.json:
        sys.stdout.write("\n")
    reason = last.finish_reason if last is not None else common_pb2.FINISH_REASON_UNSPECIFIED
    if reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH):
        return 0
    if reason == common_pb2.FINISH_REASON_UNSPECIFIED:
        print("error: the stream ended without a final message (cut short)", file=sys.stderr)
    else:
        detail = f": {last.error}" if last.error else ""
        print(f"error: the request ended with {common_pb2.FinishReason.Name(reason)}{detail}", file=sys.stderr)
    return 1
