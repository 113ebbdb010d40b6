"""`stepahead generate`: stream one completion from a gateway to stdout.

    stepahead generate --target 127.0.0.1:50050 --max-tokens 32 "def fibonacci(n):"   # default: 256 tokens
    stepahead generate --json --temperature 0 "import os"   # one JSON object per message
    stepahead generate --chat --system "Be brief." "Write a sort."  # the prompt is a user message
    stepahead generate --logprobs 3 "x ="   # per-token logprobs (and the top 3) on stderr
"""

from __future__ import annotations

import argparse
import json
import os
import sys


DEFAULT_MAX_TOKENS = 256  # a CLI answer's length; OpenAI's completions default (16) cuts a sentence short


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter  # every flag's help ends "(default: …)"
    parser.add_argument("prompt", help="prompt text")
    parser.add_argument("--target", default="127.0.0.1:50050", help="gateway address")
    parser.add_argument("--model", default="", help="served model name (default: %(default)r, the only one served)")
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                        help="most tokens to generate; the prompt plus these must fit the model's context")
    parser.add_argument("--min-tokens", type=int, default=0, help="fewest tokens to generate before EOS or a stop")
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature (None: 1.0; 0: greedy)")
    parser.add_argument("--top-k", type=int, default=-1, help="sample among the k most likely tokens (-1: all)")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (None: 1.0)")
    parser.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p times the top probability")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (None: random)")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--stop-token-ids", type=int, nargs="*", default=[], help="token ids that end the output")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    parser.add_argument("--include-stop-str-in-output", action="store_true", help="keep the stop string in the text")
    parser.add_argument("--priority", type=int, default=0, help="scheduling priority (used by --scheduling-policy priority)")
    parser.add_argument("--request-id", default="", help="request id (default: %(default)r, the gateway picks one)")
    parser.add_argument("--json", action="store_true", help="print each streamed message as JSON")
    parser.add_argument("--chat", action="store_true",
                        help="send the prompt as a user message, rendered with the model's chat template")
    parser.add_argument("--system", default=None, help="with --chat: a system message before it")
    parser.add_argument("--n", type=int, default=None, help="number of choices (--json tells them apart by index; None: 1)")
    parser.add_argument("--repetition-penalty", type=float, default=None, help="repetition penalty (None: 1.0, off)")
    parser.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI presence penalty")
    parser.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI frequency penalty")
    parser.add_argument("--logprobs", type=int, default=None, metavar="N",
                        help="raw logprobs of each output token and its N most likely alternatives (0: the token's "
                        "only); with --json in each message, else one line per token on stderr")
    parser.add_argument("--prompt-logprobs", type=int, default=None, metavar="N",
                        help="the same for each prompt token after the first")


def build_request(args: argparse.Namespace):
    from stepahead.v1 import common_pb2, generation_pb2

    sampling = common_pb2.SamplingParams(
        top_k=args.top_k, min_p=args.min_p, min_tokens=args.min_tokens,
        stop_token_ids=args.stop_token_ids, ignore_eos=args.ignore_eos,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
    )
    for name in ("temperature", "top_p", "seed", "max_tokens", "repetition_penalty", "logprobs", "prompt_logprobs"):
        value = getattr(args, name)
        if value is not None:
            setattr(sampling, name, value)
    request = generation_pb2.GenerateRequest(
        request_id=args.request_id, model=args.model, sampling=sampling,
        stop=args.stop, include_stop_str_in_output=args.include_stop_str_in_output, priority=args.priority,
    )
    if args.n is not None:
        request.n = args.n
    if args.chat:
        if args.system is not None:
            request.chat.messages.add(role="system", content=args.system)
        request.chat.messages.add(role="user", content=args.prompt)
    else:
        request.text = args.prompt
    return request


def _print_logprobs(msg) -> None:
    """`prompt|output <index> token_id logprob [top_id:logprob ...]` per entry, on stderr."""
    for kind, entries in (("prompt", msg.prompt_logprobs), ("output", msg.logprobs)):
        for e in entries:
            top = " ".join(f"{t}:{v:.4f}" for t, v in zip(e.top_token_ids, e.top_logprobs))
            print(f"{kind} {msg.index} {e.token_id} {e.logprob:.4f} {top}".rstrip(), file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    """Exit 0 only when the stream ended with a final message that finished normally
    (STOP or LENGTH); otherwise print why to stderr and exit 1."""
    import grpc
    from google.protobuf import json_format

    from stepahead import security
    from stepahead.v1 import common_pb2, generation_pb2_grpc

    last = None
    finals: dict[int, object] = {}
    with security.channel(args.target, api_key=os.environ.get("STEPAHEAD_API_KEY")) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        try:
            for msg in stub.Generate(build_request(args)):
                if msg.finish_reason:
                    finals[msg.index] = msg
                last = msg
                if args.json:
                    print(json.dumps(json_format.MessageToDict(msg, preserving_proto_field_name=True)), flush=True)
                else:
                    sys.stdout.write(msg.text)
                    sys.stdout.flush()
                    _print_logprobs(msg)
        except grpc.RpcError as exc:
            print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    if not args.json:
        sys.stdout.write("\n")
    if len(finals) == (args.n or 1):  # every choice ended: report the worst
        last = next((m for m in finals.values() if m.finish_reason not in (
            common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)), last)
    elif last is not None:
        last = None  # some choice never got its final message
    reason = last.finish_reason if last is not None else common_pb2.FINISH_REASON_UNSPECIFIED
    if reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH):
        return 0
    if reason == common_pb2.FINISH_REASON_UNSPECIFIED:
        print("error: the stream ended without a final message (cut short)", file=sys.stderr)
    else:
        detail = f": {last.error}" if last.error else ""
        print(f"error: the request ended with {common_pb2.FinishReason.Name(reason)}{detail}", file=sys.stderr)
    return 1
