"""KV transfers between workers (disaggregated prefill/decode), over real gRPC on 127.0.0.1:
a prefill runner's blocks served by its KVTransfer server and loaded into another runner's
blocks; the service's guards (block ids, cluster token); loads that fail (a dead source, a
reply that does not fit) are reported once, within the timeout, and leak no thread; the sim
worker's load takes the link's time."""

from __future__ import annotations

import queue
import threading
import time
from concurrent import futures

import grpc
import pytest
import structlog

from stepahead import security
from stepahead.plan import KVLoad, NewRequest, RunningRequest, SamplingParams, StepPlan, WorkerRole
from stepahead.ports import free_port
from stepahead.v1 import scheduler_pb2, scheduler_pb2_grpc
from tests.fixtures_models import tiny_model_dir  # noqa: F401
from worker_service.config import WorkerConfig
from worker_service.kv_loads import KVLoader
from worker_service.kv_transfer import KVTransferServer

TOKEN = "kv-secret"
GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20)
REPORT_WITHIN_S = 60.0  # a generous bound on a loaded 2-core host; a report normally comes at once
LOG = structlog.get_logger("test_kv_transfer")


def _config(**changes) -> WorkerConfig:
    return WorkerConfig(role=WorkerRole.PREFILL, cluster_token=TOKEN, **changes)


def _loader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kv-load")]


class Session:
    """A loader as an attach session holds it, its reports in a queue."""

    def __init__(self, runner, timeout_s: float = 30.0, config: WorkerConfig | None = None) -> None:
        self.reports: queue.SimpleQueue = queue.SimpleQueue()
        config = config or _config()
        self.loader = KVLoader(runner, config.scheduler_channel, timeout_s, self.reports.put, LOG)
        self.runner = runner
        runner.kv_loader = self.loader

    def report(self):
        return self.reports.get(timeout=REPORT_WITHIN_S)

    def close(self) -> None:
        self.runner.kv_loader = None
        self.loader.close()


@pytest.fixture(scope="module")
def source(tiny_model_dir):
    from worker_service.model_runner import ModelRunner

    runner = ModelRunner(tiny_model_dir, num_blocks=16, block_size=4, max_model_len=64)
    server = KVTransferServer(_config(), LOG)
    server.serve(runner)
    yield runner, server
    server.close()


@pytest.fixture(scope="module")
def destination(tiny_model_dir):
    from worker_service.model_runner import ModelRunner

    return ModelRunner(tiny_model_dir, num_blocks=16, block_size=4, max_model_len=64)


PROMPT = tuple(range(3, 15))  # 12 tokens: three blocks of 4
SRC_BLOCKS, DST_BLOCKS = (2, 3, 5), (9, 1, 4)


def test_loaded_blocks_equal_the_source_and_decode_on_as_there(source, destination) -> None:
    src, server = source
    first = src.execute(StepPlan(1, new_requests=(NewRequest("r", PROMPT, GREEDY, SRC_BLOCKS, 0, len(PROMPT)),)))
    token = first.sampled_token_ids["r"]
    session = Session(destination)
    try:
        load = KVLoad(7, server.address, SRC_BLOCKS, DST_BLOCKS, server.instance)
        destination.execute(StepPlan(1, kv_loads=(load,)))
        report = session.report()
    finally:
        session.close()
    assert (report.transfer_id, report.error) == (7, "")
    pool_src, pool_dst = src.kv_cache.device_pool, destination.kv_cache.device_pool
    assert pool_src[:, :, list(SRC_BLOCKS)].abs().sum() > 0  # the prefill wrote them
    assert bytes(src.read_kv_blocks(list(SRC_BLOCKS))) == bytes(destination.read_kv_blocks(list(DST_BLOCKS)))
    # the request resumes on the destination with its prompt's KV loaded: same next token
    blocks = DST_BLOCKS + (6,)
    resumed = destination.execute(StepPlan(2, new_requests=(
        NewRequest("r", PROMPT + (token,), GREEDY, blocks, len(PROMPT), 1, num_prompt_tokens=len(PROMPT)),)))
    continued = src.execute(StepPlan(2, running=(RunningRequest("r", (7,), 1),)))
    assert resumed.sampled_token_ids["r"] == continued.sampled_token_ids["r"]
    src.execute(StepPlan(3, finished_ids=("r",)))
    destination.execute(StepPlan(3, finished_ids=("r",)))
    assert not _loader_threads()


@pytest.mark.parametrize("device, dtype", [
    ("cpu", "bfloat16"),
    pytest.param("cuda", "bfloat16", marks=pytest.mark.gpu),  # the transfer stream, beside the compute stream
    pytest.param("cuda", "float32", marks=pytest.mark.gpu),
])
def test_a_load_between_runners_of_another_device_or_dtype(tiny_model_dir, device, dtype) -> None:  # noqa: F811
    from worker_service.model_runner import ModelRunner

    src, dst = (ModelRunner(tiny_model_dir, device=device, dtype=dtype, num_blocks=16, block_size=4,
                            max_model_len=64) for _ in range(2))
    server = KVTransferServer(_config(), LOG)
    server.serve(src)
    session = Session(dst)
    try:
        first = src.execute(StepPlan(1, new_requests=(NewRequest("r", PROMPT, GREEDY, SRC_BLOCKS, 0, len(PROMPT)),)))
        # the source decodes on while the destination reads the prompt's blocks (the decode writes block 7 only)
        decode = src.launch(StepPlan(2, running=(RunningRequest("r", (7,), 1),)))
        dst.execute(StepPlan(1, kv_loads=(KVLoad(8, server.address, SRC_BLOCKS, DST_BLOCKS, server.instance),)))
        report = session.report()
        assert report.error == ""
        assert src.read_kv_blocks(list(SRC_BLOCKS)) == dst.read_kv_blocks(list(DST_BLOCKS))
        resumed = dst.execute(StepPlan(2, new_requests=(
            NewRequest("r", PROMPT + (first.sampled_token_ids["r"],), GREEDY, DST_BLOCKS + (6,), len(PROMPT), 1,
                       num_prompt_tokens=len(PROMPT)),)))
        assert resumed.sampled_token_ids["r"] == decode.wait().sampled_token_ids["r"]
    finally:
        session.close()
        server.close()


def test_a_block_outside_the_pool_is_invalid_argument_naming_block_ids(source) -> None:
    _, server = source
    with _config().scheduler_channel(server.address) as channel:
        stub = scheduler_pb2_grpc.KVTransferStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            request = scheduler_pb2.ReadBlocksRequest(transfer_id=1, block_ids=[0, 16], instance=server.instance)
            list(stub.ReadBlocks(request, timeout=30))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "block_ids" in refused.value.details() and "16" in refused.value.details()


def test_a_read_meant_for_another_instance_is_refused_naming_it(source) -> None:
    """A worker restarted on the same address holds other KV: a read meant for the one that
    held the blocks (its hello's instance) must fail, not return whatever is there now."""
    _, server = source
    with _config().scheduler_channel(server.address) as channel:
        stub = scheduler_pb2_grpc.KVTransferStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.ReadBlocks(scheduler_pb2.ReadBlocksRequest(transfer_id=1, block_ids=[0], instance="gone"),
                                 timeout=30))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "instance" in refused.value.details()


def test_a_call_without_the_cluster_token_is_unauthenticated(source) -> None:
    _, server = source
    with grpc.insecure_channel(server.address) as channel:
        stub = scheduler_pb2_grpc.KVTransferStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.ReadBlocks(scheduler_pb2.ReadBlocksRequest(transfer_id=1, block_ids=[0]), timeout=30))
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_chunks_are_whole_blocks_each_with_the_block_size(source) -> None:
    src, server = source
    with _config().scheduler_channel(server.address) as channel:
        chunks = list(scheduler_pb2_grpc.KVTransferStub(channel).ReadBlocks(
            scheduler_pb2.ReadBlocksRequest(transfer_id=1, block_ids=[4, 0, 4], instance=server.instance), timeout=30))
    assert sum(c.num_blocks for c in chunks) == 3
    assert all(c.bytes_per_block == src.kv_bytes_per_block and len(c.data) == c.num_blocks * c.bytes_per_block
               for c in chunks)


def test_a_dead_source_fails_the_load_within_the_timeout_and_leaks_no_thread(destination) -> None:
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    timeout_s = 5.0
    session = Session(destination, timeout_s=timeout_s)
    try:
        started = time.monotonic()
        destination.execute(StepPlan(1, kv_loads=(KVLoad(11, dead, (0, 1), (2, 3)),)))
        report = session.report()
        elapsed = time.monotonic() - started
    finally:
        session.close()
    assert report.transfer_id == 11 and report.error and dead in report.error and len(report.error) <= 1000
    assert elapsed < timeout_s + 5.0  # the deadline, and grpc's slack
    assert not _loader_threads()


class _BadSource(scheduler_pb2_grpc.KVTransferServicer):
    """A source whose chunks do not fit the reader: a block size other than its own."""

    def __init__(self, bytes_per_block: int) -> None:
        self.bytes_per_block = bytes_per_block

    def ReadBlocks(self, request, context):
        yield scheduler_pb2.KVChunk(num_blocks=1, bytes_per_block=self.bytes_per_block,
                                    data=b"\0" * self.bytes_per_block)


class _StuckSource(scheduler_pb2_grpc.KVTransferServicer):
    """A source that answers nothing until released (a load in flight when the session ends)."""

    def __init__(self) -> None:
        self.called, self.release = threading.Event(), threading.Event()

    def ReadBlocks(self, request, context):
        self.called.set()
        self.release.wait(REPORT_WITHIN_S)
        return
        yield


def _serve(servicer) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2),
                         interceptors=[security.cluster_interceptor(TOKEN)])
    scheduler_pb2_grpc.add_KVTransferServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def test_a_chunk_with_another_block_size_is_refused(destination) -> None:
    server, address = _serve(_BadSource(destination.kv_bytes_per_block + 4))
    session = Session(destination)
    try:
        destination.execute(StepPlan(1, kv_loads=(KVLoad(12, address, (0,), (1,)),)))
        report = session.report()
    finally:
        session.close()
        server.stop(0).wait()
    assert report.transfer_id == 12 and "bytes" in report.error and str(destination.kv_bytes_per_block) in report.error


def test_a_session_end_drops_the_reports_of_loads_in_flight_and_joins_their_threads(destination) -> None:
    stuck = _StuckSource()
    server, address = _serve(stuck)
    session = Session(destination)
    try:
        destination.execute(StepPlan(1, kv_loads=(KVLoad(13, address, (0,), (1,)),)))
        assert stuck.called.wait(REPORT_WITHIN_S)
        session.close()  # cancels the call in flight and joins the loader's threads
        assert session.reports.empty() and not _loader_threads()
    finally:
        stuck.release.set()
        server.stop(0).wait()


def test_a_plan_loading_into_a_block_outside_the_pool_is_refused(destination) -> None:
    from worker_service.plan_checks import PlanError

    session = Session(destination)
    try:
        with pytest.raises(PlanError, match="dst_block_ids"):
            destination.execute(StepPlan(1, kv_loads=(KVLoad(14, "127.0.0.1:1", (0,), (99,)),)))
    finally:
        session.close()
    assert session.reports.empty()


def test_a_sim_load_reports_no_earlier_than_the_link_takes(tiny_model_dir) -> None:
    from worker_service.sim.profiles import LinkProfile, load_profile
    from worker_service.sim.runner import SimRunner

    link = LinkProfile("slow", bandwidth=50e6, latency_s=0.2)

    def sim() -> SimRunner:
        return SimRunner(tiny_model_dir, load_profile("h100"), dtype="float32", num_blocks=64, block_size=4,
                         kv_link=link)

    src, dst = sim(), sim()
    server = KVTransferServer(_config(), LOG)
    server.serve(src)
    session = Session(dst)
    blocks = tuple(range(8))
    try:
        started = time.monotonic()
        dst.execute(StepPlan(1, kv_loads=(KVLoad(21, server.address, blocks, blocks[::-1], server.instance),)))
        report = session.report()
        elapsed = time.monotonic() - started
    finally:
        session.close()
        server.close()
    assert report.error == ""
    assert elapsed >= link.transfer_seconds(len(blocks) * dst.kv_bytes_per_block)
    assert dst.kv_bytes_per_block == 4 * dst.geometry.kv_bytes_per_token


def test_a_sim_load_from_a_dead_source_fails_like_a_real_one(tiny_model_dir) -> None:
    from worker_service.sim.profiles import load_profile
    from worker_service.sim.runner import SimRunner

    dst = SimRunner(tiny_model_dir, load_profile("h100"), dtype="float32", num_blocks=64, block_size=4)
    session = Session(dst, timeout_s=5.0)
    dead = f"127.0.0.1:{free_port()}"
    try:
        dst.execute(StepPlan(1, kv_loads=(KVLoad(22, dead, (0,), (1,)),)))
        report = session.report()
    finally:
        session.close()
    assert report.transfer_id == 22 and dead in report.error


def test_over_mtls_the_loader_presents_the_workers_scheduler_credentials(tmp_path, destination) -> None:
    """The KVTransfer server with --kv-transfer-ssl-*; the loader dials with the TLS files the
    worker uses for its scheduler (--scheduler-ssl-*) and the cluster token."""
    from testing.certs import make_certs

    certs = make_certs(tmp_path)
    server_config = _config(kv_transfer_ssl_certfile=str(certs.server_cert),
                            kv_transfer_ssl_keyfile=str(certs.server_key), kv_transfer_ssl_ca_certs=str(certs.ca))
    server = KVTransferServer(server_config, LOG)
    server.serve(destination)
    client = _config(scheduler_ssl_ca_certs=str(certs.ca), scheduler_ssl_certfile=str(certs.client_cert),
                     scheduler_ssl_keyfile=str(certs.client_key))
    session = Session(destination, config=client)
    try:
        destination.execute(StepPlan(1, kv_loads=(KVLoad(31, server.address, (0, 1), (2, 3), server.instance),)))
        assert session.report().error == ""
        plain = Session(destination)  # no client certificate, no CA: the handshake fails
        try:
            destination.execute(StepPlan(2, kv_loads=(KVLoad(32, server.address, (0,), (4,), server.instance),)))
            failed = plain.report()
        finally:
            plain.close()
    finally:
        session.close()
        server.close()
    assert failed.transfer_id == 32 and failed.error
    assert destination.read_kv_blocks([0, 1]) == destination.read_kv_blocks([2, 3])


def test_the_attach_stream_carries_kv_loaded_and_grammar_ready_between_the_other_messages() -> None:
    from stepahead import codec
    from stepahead.plan import GrammarReady, KVLoaded
    from worker_service.attach import Pipeline

    hello = scheduler_pb2.WorkerMessage(detach="hello stand-in")
    pipeline = Pipeline(runner=None, hello=hello, log=LOG)
    pipeline.send_kv_loaded(KVLoaded(41, "source unreachable"))
    pipeline.send_grammar_ready(GrammarReady("r", "does not compile", invalid=True))
    pipeline.close()
    messages = list(pipeline.requests())
    assert messages[0] == hello
    assert codec.kv_loaded_from_proto(messages[1].kv_loaded) == KVLoaded(41, "source unreachable")
    assert codec.grammar_ready_from_proto(messages[2].grammar_ready) == GrammarReady("r", "does not compile", True)
