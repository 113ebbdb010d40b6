"""A scheduler stand-in for gateway benchmarks: the real internal protocol, no scheduling.

    PYTHONPATH=. .venv/bin/python benchmarks/experiments/replay_scheduler.py --model llama3-8b-sim \
        --port 50061 --step-ms 22

Serves `Scheduler.GetModel` (the model directory's limits) and `Scheduler.Connect`: every
`--step-ms` it sends one token per open request, the request's last one with
`FINISH_REASON_LENGTH` after its `max_tokens`, encoded by the real scheduler's writer
(`scheduler_service/event_batches.py`: a request's first and last token as full `TokenEvent`s,
the others packed as plain tokens), exactly what the real scheduler's fan-out sends at one
decode token per step. The tokens cycle through the
ids of an English text (so the gateway's detokenizer works on realistic tokens). Aborts end a
request at once. Run in its own process: its CPU is not the gateway's.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

from scheduler_service.event_batches import event_batches
from scheduler_service.core.events import RequestEvent
from model_zoo.builtin_models import resolve_model
from stepahead.plan import FinishReason
from stepahead.v1 import scheduler_pb2, scheduler_pb2_grpc

TEXT = ("The gateway streams every token of every request to its client as soon as the scheduler "
        "commits it. A benchmark that measures its cost per token has to send realistic tokens: words, "
        "spaces, punctuation, numbers like 3.14159 and 2048, and the odd emoji 🚀 or accented letter é. ")


class Replay(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, hello: scheduler_pb2.WorkerHello, token_ids: list[int], step_s: float) -> None:
        self.hello = hello
        self.token_ids = token_ids
        self.step_s = step_s

    def GetModel(self, request, context):
        return self.hello

    def Connect(self, request_iterator, context):
        lock = threading.Lock()
        open_requests: dict[str, list[int]] = {}  # id -> [tokens left, next position, prompt length]
        done = threading.Event()
        context.add_callback(done.set)

        def read() -> None:
            for msg in request_iterator:
                with lock:
                    if msg.WhichOneof("kind") == "submit":
                        s = msg.submit
                        open_requests[s.request_id] = [s.sampling.max_tokens or 16, 0, len(s.prompt_token_ids)]
                    else:
                        open_requests.pop(msg.abort.request_id, None)
            done.set()

        threading.Thread(target=read, daemon=True).start()
        ids = self.token_ids
        next_step = time.perf_counter()
        while not done.is_set():
            next_step += self.step_s
            time.sleep(max(0.0, next_step - time.perf_counter()))
            events = []
            with lock:
                for rid, state in list(open_requests.items()):
                    left, pos, prompt_len = state
                    reason = FinishReason.LENGTH if left <= 1 else None
                    events.append(RequestEvent(rid, (ids[pos % len(ids)],), reason, prompt_len, 0,
                                               queue_time=0.0 if pos == 0 else None))
                    if reason is not None:
                        del open_requests[rid]
                    else:
                        state[0], state[1] = left - 1, pos + 1
            if events:
                yield from event_batches(events)


def hello_of(model_dir: Path) -> scheduler_pb2.WorkerHello:
    config = json.loads((model_dir / "config.json").read_text())
    eos = config.get("eos_token_id", [])
    return scheduler_pb2.WorkerHello(
        worker_id="replay", model_name=model_dir.name, model_type=config.get("model_type", ""), dtype="bfloat16",
        device="replay", block_size=16, max_model_len=config.get("max_position_embeddings", 4096),
        vocab_size=config["vocab_size"], eos_token_ids=eos if isinstance(eos, list) else [eos])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3-8b-sim")
    parser.add_argument("--port", type=int, default=50061)
    parser.add_argument("--step-ms", type=float, default=22.0)
    args = parser.parse_args()
    from gateway.tokenizer import GatewayTokenizer

    model_dir = resolve_model(args.model, build=False)
    token_ids = GatewayTokenizer(model_dir).encode(TEXT * 4, add_special_tokens=False)
    server = grpc.server(futures.ThreadPoolExecutor(8))
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(Replay(hello_of(model_dir), token_ids, args.step_ms / 1e3),
                                                       server)
    port = server.add_insecure_port(f"127.0.0.1:{args.port}")
    server.start()
    print(f"replay scheduler at 127.0.0.1:{port}", flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
