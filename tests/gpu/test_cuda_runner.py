"""The CUDA path of the runner, written so that a missing stream wait makes a test fail.

A small model finishes each kernel before the host launches the next, so ordering bugs
stay invisible unless the device is made slow on purpose: these tests enqueue
`torch.cuda._sleep` on one of the runner's streams before every launch, launch a whole
workload back to back (nothing waits between launches), and compare every step's sampled
ids with the same workload run synchronously on the same device (same kernels, same
shapes, so the same bits). The workload (`plans`) has permuted block ids, placeholder
decodes whose source rows are permuted every step, prompt chunks mixed with placeholder
decodes, seeded sampling (top-k/top-p, min-p), logit bias and penalties, a `min_tokens`
request with stop ids, and
a swap out (whose freed device blocks a new request overwrites in the same step) and a
swap in of a preempted request.

Which test breaks when a wait in `worker_service/streams.py` (W*) or a host guard in
`worker_service/model_runner.py` (H*) is deleted:

| wait | what it orders | test that fails without it |
|---|---|---|
| W0 `compute.wait_stream(current)` (`wait_for_constructor`) | first step after the constructor's async KV zero-fill | `test_first_step_waits_for_the_constructor` (zero-fill delayed: it would erase the prefill's KV) |
| W1 `copy.wait_event(compute_done[slot])` (`copy_waits_for_compute`) | H2D of step t+2 after the compute of step t (same input arena) | `test_back_to_back_equals_synchronous[compute]` (step t would read step t+2's inputs) |
| W2 `compute.wait_stream(copy)` (`compute_waits_for_copies`) | compute of step t after its own H2D | `test_back_to_back_equals_synchronous[copy]` (compute would read the arena's previous contents) |
| W3 `output.wait_stream(compute)` (`output_waits_for_compute`) | D2H of the sampled ids after sampling | `test_back_to_back_equals_synchronous[compute]` (the host would get the slot's stale ids) |
| H1 `_inputs_copied[slot].synchronize()` | host rewrites the pinned arena after its previous H2D ran | `test_back_to_back_equals_synchronous[copy]` (a delayed H2D would upload the next-but-one step's inputs) |
| H2 `_retire(slot)` (`PendingStep.ids()`) | reuse of the host and device sampled-ids slot after the host read it | `test_back_to_back_equals_synchronous[output]` (and, on CPU, `tests/model/test_cuda_readiness.py::test_launching_far_ahead_still_reports_each_steps_own_ids`) |

`test_each_wait_is_needed[W*/H*]` checks this table on the device: it deletes one wait (a
monkeypatch, in a subprocess, since a race may also end in a sticky device-side assert)
and asserts that the scenario named above then diverges from the synchronous run.

`test_launch_never_blocks_the_host` runs the workload under
`torch.cuda.set_sync_debug_mode("error")` (findings 2 and 4: a pageable or blocking copy
in the `min_tokens` mask or in a swap raises) and checks that `launch` returns while a
delayed compute stream still holds the step.
"""

from __future__ import annotations

import queue
import random
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from stepahead.plan import NewRequest, RunningRequest, SamplingParams, StepPlan
from testing.checkpoints import build_checkpoint
from worker_service import model_runner as model_runner_module
from worker_service.decode_graphs import GraphSettings, graph_sizes
from worker_service.kv_cache import KVCache, block_bytes
from worker_service.model_runner import ModelRunner
from worker_service.paged_attention import PagedDecodeBackend, flash_attn_usable

pytestmark = pytest.mark.gpu

BLOCK = 16
STEPS = 20
DELAY_CYCLES = 50_000_000  # ~25 ms at 2 GHz: far longer than a step of this model
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
STOPS = tuple(range(0, 512, 8))  # 64 ids: the most stepahead.limits allows
SAMPLING = {
    "r0": SamplingParams(temperature=0.0, max_tokens=64, logit_bias=((5, 1.5), (77, -3.0))),
    "r1": SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=1, max_tokens=64),
    "r2": SamplingParams(temperature=0.0, min_tokens=8, stop_token_ids=STOPS, max_tokens=64),
    "r3": SamplingParams(temperature=1.0, min_p=0.05, seed=3, max_tokens=64, repetition_penalty=1.3,
                         presence_penalty=0.4),
    "r4": GREEDY,
}
PROMPT_LENS = {"r0": 11, "r1": 7, "r2": 9, "r3": 19, "r4": 30}

Outputs = dict[str, list[int]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.backends.cuda.matmul.allow_tf32 = False
    path = tmp_path_factory.mktemp("cuda-llama")
    build_checkpoint(path, "llama", seed=5, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=2)
    return path


def _prompts() -> dict[str, tuple[int, ...]]:
    rng = random.Random(0)
    return {rid: tuple(rng.randrange(512) for _ in range(n)) for rid, n in PROMPT_LENS.items()}


def plans(outputs: Outputs) -> Callable[[int], StepPlan]:
    """Step t's plan; `outputs` must hold every id sampled before step t - 1 (r1's resume
    at step 8 resends its prompt + outputs)."""
    prompts = _prompts()
    perm = random.Random(1).sample(range(64), 64)
    blocks = {rid: tuple(perm[4 * i : 4 * i + 4]) for i, rid in enumerate(["r0", "r1", "r2", "r3"])}
    blocks["r4"] = blocks["r1"]  # r1 is swapped out at step 6; r4 takes its device blocks
    resumed_blocks = tuple(perm[16:20])
    host = ((blocks["r1"][0], 3), (blocks["r1"][1], 0), (blocks["r1"][2], 2), (blocks["r1"][3], 1))
    swap_in = ((3, resumed_blocks[0]), (0, resumed_blocks[1]), (2, resumed_blocks[2]), (1, resumed_blocks[3]))

    def new(rid, scheduled=None, computed=0):
        tokens = prompts[rid]
        return NewRequest(rid, tokens, SAMPLING[rid], blocks[rid], computed, scheduled or len(tokens), len(tokens))

    def decodes(t, rids):
        rids = rids[t % len(rids):] + rids[: t % len(rids)]  # rotate: placeholder source rows permute
        return tuple(RunningRequest(rid, (), 1, True) for rid in rids)

    def plan(t: int) -> StepPlan:
        if t == 0:
            return StepPlan(0, new_requests=(new("r0"), new("r1"), new("r2")))
        if t in (1, 2):
            return StepPlan(t, running=decodes(t, ["r0", "r1", "r2"]))
        if t == 3:  # a prompt chunk mixed with placeholder decodes, no sample
            return StepPlan(3, new_requests=(new("r3", scheduled=10),), running=decodes(t, ["r0", "r1", "r2"]))
        if t == 4:  # the rest of r3's prompt: it samples
            return StepPlan(4, running=(RunningRequest("r3", (), 9),) + decodes(t, ["r0", "r1", "r2"]))
        if t == 5:
            return StepPlan(5, running=decodes(t, ["r0", "r1", "r2", "r3"]))
        if t == 6:  # swap r1 out; r4 overwrites r1's device blocks in this same step
            return StepPlan(6, new_requests=(new("r4"),), running=decodes(t, ["r0", "r2", "r3"]),
                            preempted_ids=("r1",), swap_out=host)
        if t == 7:
            return StepPlan(7, running=decodes(t, ["r0", "r2", "r3", "r4"]))
        if t == 8:  # r1 resumes from the host pool into other device blocks
            tokens = prompts["r1"] + tuple(outputs["r1"][:6])  # sampled in steps 0-5
            r1 = NewRequest("r1", tokens, SAMPLING["r1"], resumed_blocks, len(tokens) - 1, 1, len(prompts["r1"]))
            return StepPlan(8, new_requests=(r1,), running=decodes(t, ["r0", "r2", "r3", "r4"]), swap_in=swap_in)
        return StepPlan(t, running=decodes(t, ["r0", "r1", "r2", "r3", "r4"]))

    return plan


def runner_for(model_dir, **kwargs) -> ModelRunner:
    return ModelRunner(model_dir, device="cuda", block_size=BLOCK, num_blocks=64, num_host_blocks=8, **kwargs)


def run_synchronously(runner: ModelRunner) -> tuple[list[dict[str, int]], Outputs]:
    outputs: Outputs = {}
    plan = plans(outputs)
    results = []
    for t in range(STEPS):
        ids = runner.execute(plan(t)).sampled_token_ids
        torch.cuda.synchronize()
        results.append(ids)
        for rid, tok in ids.items():
            outputs.setdefault(rid, []).append(tok)
    return results, outputs


def delay(stream: torch.cuda.Stream | None) -> None:
    if stream is not None:
        with torch.cuda.stream(stream):
            torch.cuda._sleep(DELAY_CYCLES)


def launched_back_to_back(runner: ModelRunner, outputs: Outputs, slow_stream: str) -> list[dict[str, int]]:
    """Every step's sampled ids, the workload launched with no wait between launches and the runner's
    `slow_stream` ("none", "compute", "copy" or "output") delayed before each launch."""
    stream = None if slow_stream == "none" else getattr(runner.streams, slow_stream)
    plan = plans(outputs)
    pending = []
    for t in range(STEPS):
        delay(stream)
        pending.append(runner.launch(plan(t)))
    return [p.wait().sampled_token_ids for p in pending]


@pytest.fixture(scope="module")
def reference(model_dir):
    results, outputs = run_synchronously(runner_for(model_dir))
    assert all(t not in STOPS for t in outputs["r2"][:8]), "min_tokens: a stop id was sampled early"
    return results, outputs


@pytest.mark.parametrize("slow_stream", ["none", "compute", "copy", "output"])
def test_back_to_back_equals_synchronous(model_dir, reference, slow_stream):
    """Guards W1 + W3 (compute delayed), W2 + H1 (copy delayed), H2 (output delayed)."""
    want, outputs = reference
    assert launched_back_to_back(runner_for(model_dir), outputs, slow_stream) == want


def test_steps_run_on_the_dedicated_stream_from_any_thread(model_dir, reference):
    """Finding 7: the daemon launches on its execution thread and waits on its sender thread;
    the forward must run on the runner's own non-default stream whichever thread launches."""
    want, outputs = reference
    runner = runner_for(model_dir)
    streams_seen = []
    forward = runner._forward
    runner._forward = lambda inputs, arena=None: (streams_seen.append(torch.cuda.current_stream()),
                                                  forward(inputs, arena))[1]
    plan = plans(outputs)
    launched: queue.Queue = queue.Queue()

    def execute():
        for t in range(STEPS):
            delay(runner.streams.compute)
            launched.put(runner.launch(plan(t)))

    thread = threading.Thread(target=execute)
    thread.start()
    got = [launched.get(timeout=60).wait().sampled_token_ids for _ in range(STEPS)]
    thread.join()
    assert got == want
    assert all(s == runner.streams.compute for s in streams_seen)
    assert runner.streams.compute != torch.cuda.default_stream()


def test_first_step_waits_for_the_constructor(model_dir, reference, monkeypatch):
    """W0: the KV pool's zero-fill is queued behind a sleep on the constructor's stream; the
    prefill's KV writes on the compute stream must come after it, not be erased by it."""
    want, outputs = reference

    class SlowZeroKV(KVCache):
        def __init__(self, *args, **kwargs):
            if kwargs.get("num_blocks"):  # the real pool, not the profiling one
                torch.cuda._sleep(DELAY_CYCLES * 5)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(model_runner_module, "KVCache", SlowZeroKV)
    runner = runner_for(model_dir)
    plan = plans(outputs)
    pending = [runner.launch(plan(t)) for t in range(STEPS)]
    assert [p.wait().sampled_token_ids for p in pending] == want


def test_launch_never_blocks_the_host(model_dir, reference):
    """Findings 2 and 4: no synchronising copy in launch (min_tokens mask, swaps, sampling
    metadata, inputs); and launch returns while the delayed compute stream holds the step."""
    want, outputs = reference
    runner = runner_for(model_dir)
    plan = plans(outputs)
    got, in_flight = [], []
    torch.cuda.synchronize()
    for t in range(STEPS):
        delay(runner.streams.compute)
        torch.cuda.set_sync_debug_mode("error")
        try:
            step = runner.launch(plan(t))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert not step.done.query(), f"step {t}: launch returned after the device finished it"
        in_flight.append(step)
        if len(in_flight) == 2:  # the scheduler's window: wait for t - 1 after launching t
            got.append(in_flight.pop(0).wait().sampled_token_ids)
    got += [p.wait().sampled_token_ids for p in in_flight]
    assert got == want


def test_cuda_logits_match_cpu(model_dir, reference):
    """The same plans on CPU: every step's logits agree (float32, TF32 off)."""
    _, outputs = reference
    cpu = ModelRunner(model_dir, block_size=BLOCK, num_blocks=64, num_host_blocks=8)
    cuda = runner_for(model_dir)
    plan = plans(outputs)
    for t in range(STEPS):
        cpu.execute(plan(t))
        cuda.execute(plan(t))
        assert cuda.last_logits_ids == cpu.last_logits_ids
        if cpu.last_logits_ids:
            torch.testing.assert_close(cuda.last_logits.cpu(), cpu.last_logits, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("kernel", ["torch", "flash-attn"])
def test_paged_decode_backend_matches_reference_backend(model_dir, reference, kernel):
    """`--attention-backend paged` (device-side decode metadata) against the torch backend."""
    dtype = "bfloat16" if kernel == "flash-attn" else "float32"
    block = 256 if kernel == "flash-attn" else BLOCK
    if kernel == "flash-attn" and not flash_attn_usable(torch.device("cuda"), torch.bfloat16, block):
        pytest.skip("flash-attn is not installed")
    _, outputs = reference
    ref = ModelRunner(model_dir, device="cuda", dtype=dtype, block_size=block, num_blocks=64, num_host_blocks=8)
    paged = ModelRunner(model_dir, device="cuda", dtype=dtype, block_size=block, num_blocks=64, num_host_blocks=8,
                        attention_backend=PagedDecodeBackend(use_flash_attn=kernel == "flash-attn"))
    assert paged.backend.kernel == kernel
    plan = plans(outputs)
    tol = 5e-2 if dtype == "bfloat16" else 1e-4  # bf16: the two kernels round differently
    for t in range(STEPS):
        ref.execute(plan(t))
        paged.execute(plan(t))
        if ref.last_logits_ids:
            torch.testing.assert_close(paged.last_logits, ref.last_logits, rtol=tol, atol=tol)


def test_padding_rows_write_only_the_dummy_block(model_dir, reference):
    """Decode-only steps are padded to bucket sizes; padding rows must write nowhere but the
    dummy block (blocks no request was given stay zero)."""
    _, outputs = reference
    runner = runner_for(model_dir)
    padded = []
    orig = runner._forward
    runner._forward = lambda inputs, arena=None: (padded.append(inputs.num_padding), orig(inputs, arena))[1]
    plan = plans(outputs)
    used = set()
    for t in range(STEPS):
        p = plan(t)
        for r in p.new_requests:
            used.update(r.block_ids)
        runner.execute(p)
    assert max(padded) > 0
    unused = sorted(set(range(runner.num_blocks)) - used)
    assert unused and runner.kv_cache.device_pool[:, :, unused].abs().sum().item() == 0
    assert runner.kv_cache.device_pool[:, :, runner.kv_cache.dummy_block].abs().sum().item() > 0


def test_kv_cache_is_sized_after_a_profiling_step(model_dir):
    """Finding 8: the KV pool takes what a profiling run at the largest step shapes leaves of
    the budget; a real step at those shapes then fits in the budget."""
    seqs, max_len = 32, 512
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    utilization = min(1.0, (total - free + (2 << 30)) / total)  # ~2 GiB beyond what is in use now
    runner = ModelRunner(model_dir, device="cuda", block_size=BLOCK, max_model_len=max_len, max_num_seqs=seqs,
                         max_num_batched_tokens=max_len, gpu_memory_utilization=utilization)
    split = runner.memory_split
    assert split is not None and split.step_peak > 0 and split.kv_cache > 0
    kv_bytes = runner.num_blocks * block_bytes(runner.config, BLOCK, runner.dtype)
    assert split.kv_cache - block_bytes(runner.config, BLOCK, runner.dtype) < kv_bytes <= split.kv_cache
    per_req = max_len // BLOCK
    assert runner.num_blocks >= seqs * per_req, "test needs room for every request at max_model_len"
    prompts = [tuple(random.Random(i).randrange(512) for _ in range(max_len - 1)) for i in range(seqs)]
    for i, p in enumerate(prompts):  # one prompt per step: max_num_batched_tokens each
        blocks = tuple(range(i * per_req, (i + 1) * per_req))
        runner.execute(StepPlan(i, new_requests=(NewRequest(f"r{i}", p, GREEDY, blocks, 0, len(p)),)))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    runner.execute(StepPlan(seqs, running=tuple(RunningRequest(f"r{i}", (), 1) for i in range(seqs))))
    torch.cuda.synchronize()
    step_peak = torch.cuda.max_memory_allocated() - before
    assert step_peak <= split.step_peak, "the profiling run under-estimated a real step at its shapes"
    assert torch.cuda.max_memory_allocated() <= split.budget - split.non_torch


@pytest.mark.parametrize("wait", ["W0", "W1", "W2", "W3", "H1", "H2"])
def test_each_wait_is_needed(model_dir, wait):
    """Deleting the wait makes its scenario diverge (or fail on the device)."""
    proc = subprocess.run([sys.executable, "-m", "tests.gpu.wait_mutations", str(model_dir), wait],
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2])
    out = proc.stdout + proc.stderr
    assert "control: equal" in out, f"the scenario fails even with every wait in place:\n{out[-3000:]}"
    assert proc.returncode != 0 or "mutant: diverged" in out, f"{wait} removed, nothing broke:\n{out[-3000:]}"


def graphed_runner(model_dir) -> ModelRunner:
    """Decode steps replayed from CUDA graphs (every padded decode size), over the paged backend."""
    return runner_for(model_dir, attention_backend=PagedDecodeBackend(),
                      decode_graphs=GraphSettings(graph_sizes((), 512, 256)))


@pytest.fixture(scope="module")
def paged_reference(model_dir, reference):
    """The workload's per-step ids and logits on the eager paged backend (the graphs' kernels)."""
    _, outputs = reference
    runner = runner_for(model_dir, attention_backend=PagedDecodeBackend())
    plan = plans(outputs)
    steps = []
    for t in range(STEPS):
        ids = runner.execute(plan(t)).sampled_token_ids
        steps.append((ids, runner.last_logits.clone() if runner.last_logits_ids else None))
    return steps


def test_graphed_decode_steps_equal_eager(model_dir, reference, paged_reference):
    """Every decode-only step replays a CUDA graph (captured on its shape's first step); each step's
    ids equal the eager forward's and its logits too, within float32 rounding (the same kernels on the
    same inputs; a stale input is off by far more)."""
    _, outputs = reference
    runner = graphed_runner(model_dir)
    plan = plans(outputs)
    for t in range(STEPS):
        ids = runner.execute(plan(t)).sampled_token_ids
        want_ids, want_logits = paged_reference[t]
        assert ids == want_ids, f"step {t}"
        if want_logits is not None:
            torch.testing.assert_close(runner.last_logits, want_logits, rtol=1e-5, atol=1e-5, msg=f"step {t}")
    assert runner.graphs.num_captured >= 2 and runner.graphs.num_replays >= 8


@pytest.mark.parametrize("slow_stream", ["none", "compute", "copy", "output"])
def test_graphed_back_to_back_equals_synchronous(model_dir, reference, paged_reference, slow_stream):
    """Replays launched back to back with one stream slowed: a replay must read its own step's inputs
    (the copy into the graphs' arena ordered after the step's H2D and before the replay)."""
    _, outputs = reference
    runner = graphed_runner(model_dir)
    assert launched_back_to_back(runner, outputs, slow_stream) == [ids for ids, _ in paged_reference]
    assert runner.graphs.num_replays >= 8


def test_flashinfer_backend_matches_reference_backend(model_dir, reference):
    """`--attention-backend flashinfer` (its paged decode and prefill kernels at block size 16) against
    the torch backend, in bfloat16 (FlashInfer's dtypes), through the whole workload."""
    import importlib.util

    if importlib.util.find_spec("flashinfer") is None:
        pytest.skip("flashinfer-python is not installed")
    from worker_service.flashinfer_attention import FlashInferBackend

    _, outputs = reference
    ref = ModelRunner(model_dir, device="cuda", dtype="bfloat16", block_size=BLOCK, num_blocks=64, num_host_blocks=8)
    fi = ModelRunner(model_dir, device="cuda", dtype="bfloat16", block_size=BLOCK, num_blocks=64, num_host_blocks=8,
                     attention_backend=FlashInferBackend(torch.device("cuda")))
    plan = plans(outputs)
    for t in range(STEPS):
        ref.execute(plan(t))
        fi.execute(plan(t))
        if ref.last_logits_ids:
            torch.testing.assert_close(fi.last_logits, ref.last_logits, rtol=5e-2, atol=5e-2, msg=f"step {t}")
