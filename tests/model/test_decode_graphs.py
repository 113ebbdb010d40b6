"""Decode graphs (`worker_service/decode_graphs.py`) on CPU, with `EagerReplay` in place of a CUDA
graph: a replay re-runs the captured call over the tensors it was captured with, so these tests
check the part of graph replay that is not the device's: which steps replay, that every replayed
step's inputs reach the captured tensors, and that a graph's output equals the eager forward's to
the bit. The same workload on CUDA (`tests/gpu/test_cuda_runner.py`) compares real graphs.

Each correctness test has a mutation beside it that must break it: a replay that skips the copy of
the step's inputs (it reads the previous step's), and graphs captured over one of the runner's two
step arenas (a step in the other one replays stale inputs).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.model.driver import ToyRequest, ToyScheduler
from tests.model.oracle import MAX_NEW, check_against_hf, oracle_case
from worker_service.decode_graphs import DecodeGraphs, EagerReplay, GraphSettings, graph_sizes
from worker_service.model_runner import ModelRunner
from worker_service.paged_attention import PagedDecodeBackend

SIZES = (1, 2, 4, 8)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("graphs")
    _, prompts, expected = oracle_case(path, "llama_tied_gqa4", seed=11, prompt_seed=5, lens=[6, 37, 18, 4, 29, 61, 11])
    return path, prompts, expected


def _runner(path, graphs: bool) -> ModelRunner:
    return ModelRunner(path, num_blocks=200, block_size=8, max_num_seqs=8, pad_decode_batches=True,
                       attention_backend=PagedDecodeBackend(),
                       decode_graphs=GraphSettings(SIZES, EagerReplay) if graphs else None)


def _run(runner: ModelRunner, prompts) -> tuple[ToyScheduler, list[tuple]]:
    """The workload: requests joining every other step (decode batches of 1 to 7 rows, padded to
    1, 2, 4 and 8), prompt chunks beside decodes, placeholder inputs every other step. Returns the
    scheduler and every step's (sampled ids, logits)."""
    steps = []
    execute = runner.execute

    def record(plan):
        result = execute(plan)
        steps.append((result.sampled_token_ids, runner.last_logits.clone()))
        return result

    runner.execute = record
    sched = ToyScheduler(runner, chunk=16, token_budget=48, max_running=7)
    for i, p in enumerate(prompts):
        sched.add(ToyRequest(f"r{i}", p, MAX_NEW, arrival_step=2 * i))
    sched.run()
    return sched, steps


@pytest.fixture(scope="module")
def eager_steps(checkpoint):
    path, prompts, _ = checkpoint
    return _run(_runner(path, graphs=False), prompts)[1]


def _diverged(steps, want) -> bool:
    return len(steps) != len(want) or any(ids != w_ids or not torch.equal(logits, w_logits)
                                          for (ids, logits), (w_ids, w_logits) in zip(steps, want))


def test_replayed_decode_steps_equal_the_eager_ones_bit_for_bit(checkpoint, eager_steps):
    path, prompts, expected = checkpoint
    runner = _runner(path, graphs=True)
    sched, steps = _run(runner, prompts)
    graphs = runner.graphs
    assert graphs.num_captured >= 3, "the workload should meet several decode shapes"
    assert graphs.num_replays > 2 * graphs.num_captured, "most decode steps should replay a captured graph"
    assert not _diverged(steps, eager_steps)
    assert check_against_hf(sched, prompts, expected) >= len(prompts) - 1
    assert not runner.requests


def test_a_replay_without_the_steps_inputs_is_caught(checkpoint, eager_steps, monkeypatch):
    path, prompts, _ = checkpoint
    monkeypatch.setattr(DecodeGraphs, "_load", lambda self, arena, end: None)  # replays the inputs it captured
    runner = _runner(path, graphs=True)
    assert _diverged(_run(runner, prompts)[1], eager_steps)


def test_graphs_over_one_step_arena_are_caught(checkpoint, eager_steps, monkeypatch):
    """A graph captured over the runner's own arena of one step parity reads stale inputs in every step of
    the other (the runner's arenas alternate): why the graphs have an arena of their own."""
    path, prompts, _ = checkpoint
    monkeypatch.setattr(DecodeGraphs, "_load", lambda self, arena, end: None)
    runner = _runner(path, graphs=True)
    runner.graphs.static = runner.buffers[0]
    assert _diverged(_run(runner, prompts)[1], eager_steps)


class _OutOfMemory(EagerReplay):
    def capture(self, fn):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_a_shape_without_memory_for_its_graph_runs_eagerly(checkpoint, eager_steps, caplog):
    path, prompts, _ = checkpoint
    runner = ModelRunner(path, num_blocks=200, block_size=8, max_num_seqs=8, pad_decode_batches=True,
                         attention_backend=PagedDecodeBackend(), decode_graphs=GraphSettings(SIZES, _OutOfMemory))
    with caplog.at_level("WARNING", logger="worker_service.decode_graphs"):
        steps = _run(runner, prompts)[1]
    assert not _diverged(steps, eager_steps)
    assert runner.graphs.num_captured == 0 and runner.graphs.num_replays == 0
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings and all("run eagerly" in w and "out of device memory" in w for w in warnings)
    assert len(warnings) == len(set(warnings)), "one warning per shape"


def test_graphs_need_a_graph_safe_backend_and_padded_batches(checkpoint):
    path, _, _ = checkpoint
    with pytest.raises(ValueError, match="graph-safe attention backend"):
        ModelRunner(path, num_blocks=16, block_size=8, pad_decode_batches=True,
                    decode_graphs=GraphSettings(SIZES, EagerReplay))
    with pytest.raises(ValueError, match="padded"):
        ModelRunner(path, num_blocks=16, block_size=8, pad_decode_batches=False,
                    attention_backend=PagedDecodeBackend(), decode_graphs=GraphSettings(SIZES, EagerReplay))


def test_graph_sizes():
    assert graph_sizes((), 512, 256) == (1, 2, 4) + tuple(range(8, 257, 8))
    assert graph_sizes((), 16, 256) == (1, 2, 4, 8, 16)
    assert graph_sizes((), 512, 5) == (1, 2, 4, 5)  # 5 requests at most: a batch of 5 is padded to 5
    assert graph_sizes((64, 8, 1, 1), 32, 256) == (1, 8)
    for bad in (12, 0, 264):
        with pytest.raises(ValueError, match=f"--cuda-graph-sizes: {bad} is no decode batch size"):
            graph_sizes((8, bad), 512, 256)


def test_graph_flags_resolve_on_cuda_only():
    from worker_service.config import WorkerConfig
    from worker_service.runners import resolve_decode_graphs

    cuda = WorkerConfig(device="cuda", enforce_eager=False, max_num_seqs=64)
    assert resolve_decode_graphs(cuda, enforce_eager=False).sizes == (1, 2, 4) + tuple(range(8, 65, 8))
    assert resolve_decode_graphs(replace(cuda, cuda_graph_sizes=("1", "8", "16")), False).sizes == (1, 8, 16)
    assert resolve_decode_graphs(replace(cuda, max_cuda_graph_batch_size=8), False).sizes == (1, 2, 4, 8)
    assert resolve_decode_graphs(replace(cuda, max_cuda_graph_batch_size=0), False) is None
    assert resolve_decode_graphs(cuda, enforce_eager=True) is None
    assert resolve_decode_graphs(replace(cuda, device="cpu"), False) is None
    with pytest.raises(ValueError, match="--cuda-graph-sizes: integers, got '8,x'"):
        resolve_decode_graphs(replace(cuda, cuda_graph_sizes=("8", "x")), False)
    with pytest.raises(ValueError, match="--max-cuda-graph-batch-size must be >= 0"):
        resolve_decode_graphs(replace(cuda, max_cuda_graph_batch_size=-1), False)


def test_auto_attention_is_the_graph_safe_backend_under_graphs():
    from worker_service.attention_names import AttentionBackendName
    from worker_service.paged_attention import make_backend

    cpu = torch.device("cpu")
    assert isinstance(make_backend(AttentionBackendName.AUTO, cpu, torch.float32, 16, graphs=True), PagedDecodeBackend)
    assert not make_backend(AttentionBackendName.AUTO, cpu, torch.float32, 16).graph_safe
