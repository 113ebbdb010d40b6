"""`stepahead trace`: the flight recorder as a Perfetto trace and a PNG timeline.

    stepahead trace --out traces/            # against the running `stepahead serve`
    stepahead trace --target HOST:PORT       # any scheduler; STEPAHEAD_CLUSTER_TOKEN its token

Without `--target`, the scheduler address and cluster token come from the file a running
`stepahead serve` writes (`cli.runfile`). Writes
`trace.json` (open it in ui.perfetto.dev or chrome://tracing) and `timeline.png` with one
lane for the scheduler's CPU work and one per replica for its worker's device work; the
gaps in a device lane are time that device sat idle.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cli import runfile

from stepahead.flight_recorder import StepRecord, device_idle_fraction, to_chrome_trace


def fetch_records(target: str | None, token: str | None = None) -> tuple[str, list[StepRecord]]:
    """The scheduler's flight record (`cli.runfile.scheduler_access` finds the address
    and the cluster token a flag does not give)."""
    from stepahead import codec, security
    from stepahead.v1 import scheduler_pb2, scheduler_pb2_grpc

    target, token = runfile.scheduler_access(target, token)
    with security.channel(target, cluster_token=token) as channel:
        record = scheduler_pb2_grpc.SchedulerStub(channel).GetFlightRecord(
            scheduler_pb2.GetFlightRecordRequest(), timeout=30
        )
    return record.worker_id, [codec.step_record_from_proto(s) for s in record.steps]


def plot_timeline(records: list[StepRecord], path: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(r.schedule_start for r in records)
    lanes = {
        "scheduler CPU": [(r.schedule_start, r.schedule_end) for r in records]
        + [(r.commit_start, r.result_committed) for r in records if r.commit_start > 0],
    }
    for replica in dict.fromkeys(r.replica for r in records):  # one device lane per replica
        lanes[f"worker {replica}".strip()] = [(r.worker.forward_start, r.worker.forward_end) for r in records
                                              if r.replica == replica and r.worker.forward_end > 0]
    fig, ax = plt.subplots(figsize=(14, 1.4 + 0.6 * len(lanes)))
    for y, (name, spans) in enumerate(lanes.items()):
        bars = [((a - t0) * 1e3, (b - a) * 1e3) for a, b in spans if b >= a > 0]
        ax.broken_barh(bars, (y - 0.35, 0.7), color="tab:orange" if y == 0 else "tab:blue")
    ax.set_yticks(range(len(lanes)), list(lanes))
    ax.set_xlabel("ms")
    idle = device_idle_fraction(records)
    ax.set_title(f"{title} last {len(records)} steps — device idle {idle:.1%}".strip())
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_trace(target: str, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)  # a bad --out fails before the scheduler is asked
    worker_id, records = fetch_records(target)
    if not records:
        raise SystemExit("the flight recorder is empty: run some requests first")
    (out / "trace.json").write_text(json.dumps(to_chrome_trace(records, worker_name=f"worker {worker_id}")))
    plot_timeline(records, out / "timeline.png")
    return {"steps": len(records), "device_idle_fraction": device_idle_fraction(records),
            "trace": str(out / "trace.json"), "timeline": str(out / "timeline.png")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=None,
                        help="scheduler address (default: the running `stepahead serve`'s, else 127.0.0.1:50051)")
    parser.add_argument("--out", type=Path, default=Path("trace"), help="output directory")


def run(args: argparse.Namespace) -> int:
    import grpc

    try:
        print(json.dumps(write_trace(args.target, args.out), indent=2))
    except grpc.RpcError as exc:
        print(f"stepahead trace: the scheduler refused or did not answer: {exc.code().name}: {exc.details()}"
              + (" (set STEPAHEAD_CLUSTER_TOKEN to the scheduler's cluster token)"
                 if exc.code() == grpc.StatusCode.UNAUTHENTICATED else ""), file=sys.stderr)
        return 1
    except OSError as exc:  # --out cannot be made or written
        print(f"stepahead trace: --out {args.out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    return 0
