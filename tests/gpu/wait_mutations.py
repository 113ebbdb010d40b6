"""Run one gpu-test scenario with one stream wait or host guard deleted (see the table in
`test_cuda_runner.py`); prints "control: equal" for the intact runner, then
"mutant: diverged" or "mutant: equal". A device-side assert may end the process instead.

    python -m tests.gpu.wait_mutations MODEL_DIR W1
"""

from __future__ import annotations

import sys

import pytest
import torch

from tests.gpu import test_cuda_runner as t
from worker_service.streams import DeviceStreams, StepEvent


def _no_copy_events(runner) -> None:
    record = runner.streams.record
    runner.streams.record = lambda name: StepEvent() if name == "copy" else record(name)


# wait -> (how to delete it on a runner, the stream to delay)
MUTATIONS = {
    "W1": (lambda r: setattr(r.streams, "copy_waits_for_compute", lambda event: None), "compute"),
    "W2": (lambda r: setattr(r.streams, "compute_waits_for_copies", lambda: None), "copy"),
    "W3": (lambda r: setattr(r.streams, "output_waits_for_compute", lambda: None), "compute"),
    "H1": (_no_copy_events, "copy"),
    "H2": (lambda r: setattr(r, "_retire", lambda slot: None), "output"),
}


def back_to_back(runner, outputs, stream_name: str | None) -> list[dict[str, int]]:
    stream = getattr(runner.streams, stream_name) if stream_name else None
    plan = t.plans(outputs)
    pending = []
    for step in range(t.STEPS):
        t.delay(stream)
        pending.append(runner.launch(plan(step)))
    return [p.wait().sampled_token_ids for p in pending]


def constructor_scenario(model_dir, outputs) -> list[dict[str, int]]:
    with pytest.MonkeyPatch.context() as mp:
        class SlowZeroKV(t.KVCache):
            def __init__(self, *args, **kwargs):
                if kwargs.get("num_blocks"):
                    torch.cuda._sleep(t.DELAY_CYCLES * 5)
                super().__init__(*args, **kwargs)

        mp.setattr(t.model_runner_module, "KVCache", SlowZeroKV)
        return back_to_back(t.runner_for(model_dir), outputs, None)


def main(model_dir: str, wait: str) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    want, outputs = t.run_synchronously(t.runner_for(model_dir))
    if wait == "W0":
        print("control:", "equal" if constructor_scenario(model_dir, outputs) == want else "diverged", flush=True)
        DeviceStreams.wait_for_constructor = lambda self: None
        print("mutant:", "equal" if constructor_scenario(model_dir, outputs) == want else "diverged", flush=True)
        return
    delete, stream = MUTATIONS[wait]
    control = back_to_back(t.runner_for(model_dir), outputs, stream)
    print("control:", "equal" if control == want else "diverged", flush=True)
    runner = t.runner_for(model_dir)
    delete(runner)
    print("mutant:", "equal" if back_to_back(runner, outputs, stream) == want else "diverged", flush=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
