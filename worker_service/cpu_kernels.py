"""Hand-written CPU kernels (C++, built once per machine with torch's extension builder).

`paged_decode` (`csrc/paged_decode_cpu.cpp`): float32 decode attention straight over the
paged KV cache, one task per request on torch's intra-op threads. Where the build has AVX-512
(and a head dim of 16, 32, 64, 80, 96, 128 or 256) it runs a loop written for those registers;
elsewhere a portable loop the compiler vectorizes. Both read the cache in the same order, each block's rows
front to back, and a decode step at a large batch reads float32 K/V near the machine's memory
bandwidth (`benchmarks/experiments/profile_decode.py`).
`benchmarks/experiments/decode_kernel.py` times one layer of each. The reference path
(`attention.TorchAttentionBackend`) gathers each request's blocks into a buffer and runs SDPA
over it, which on a CPU costs a write and a re-read of every K/V byte besides the read the
attention itself needs; the kernel reads each byte once. It supports what the reference
decode does: GQA, a sliding window, logit soft-capping and attention sinks.
`write_kv` (same file) writes a step's K/V rows into their cache slots in one call, where torch
takes two `index_copy_` and their views.

`add_rms_norm`, `rms_norm`, `silu_and_mul`, `rotary_` (`csrc/layer_ops_cpu.cpp`): the elementwise parts of a
decoder layer, each one pass where torch runs two to four ops with a temporary between each
(the residual add and the RMSNorm after it; SiLU(gate) * up; the rotary embedding, in place).
At a decode step's few rows these ops cost their calls more than their arithmetic. The runner
hands them to the model's eligible modules (`attach_layer_ops`); each module takes the torch
ops instead under `torch.compile` (inductor fuses them itself) and for anything but float32 on
the CPU. The results equal the torch ops' within float32 rounding.

The build (g++, ninja, `-O3 -march=native`) goes to `$STEPAHEAD_CACHE_DIR/torch_extensions/`
under a name hashed from the sources, the CPU's flags and the torch installation, so a restart
loads the cached library, a cache shared between machines never loads code built for another
CPU, and two venvs never rebuild each other's (torch's header and library paths are in the
build's commands, and ninja rebuilds when a command changes).
`load()` builds or loads it once per process, logs the time it took, and returns None where
it cannot (no compiler; the reason is logged as a warning), so the worker falls back to the
reference path instead of failing. Processes that load at once (the workers of one host) take
turns under an `flock` on the build directory's `stepahead.lock`, which the kernel releases when
its holder dies. Torch's own guard, a `lock` file that its builder deletes when done, is left
behind by a builder that was killed, and then every later load waits on it forever; under the
`flock` no live builder holds one, so a `lock` file found there is stale and removed. The build
compiles copies of the sources in the build directory, so every checkout of the same sources
shares one build (`_sources_in`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import platform
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(CSRC / name for name in ("cpu_kernels.cpp", "paged_decode_cpu.cpp", "layer_ops_cpu.cpp"))
HEADERS = (CSRC / "cpu_math.h",)  # included by the sources: in the build's name too
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno")

_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}  # "cpu_kernels" -> the module, or None where the build failed


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:  # not Linux: the machine and processor names stand in for the flags
        pass
    return f"{platform.machine()} {platform.processor()}"


def _torch_dir() -> str:
    """Where this process's torch is installed: its headers and libraries are in the build's
    commands, so each installation (each venv) gets a build of its own."""
    return str(Path(torch.__file__).resolve().parent)


def _build_name() -> str:
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in SOURCES + HEADERS) + " ".join(CFLAGS).encode()
                            + _cpu_flags().encode() + torch.__version__.encode() + _torch_dir().encode()
                            ).hexdigest()[:16]
    return f"stepahead_cpu_kernels_{digest}"


def load() -> ModuleType | None:
    """The built kernel module (built on first use, then cached on disk), or None."""
    with _lock:
        if "cpu_kernels" not in _loaded:
            _loaded["cpu_kernels"] = _build()
        return _loaded["cpu_kernels"]


def build_dir() -> Path:
    """Where this machine's build of these sources lives (`$STEPAHEAD_CACHE_DIR/torch_extensions/<name>`)."""
    from model_zoo.builtin_models import cache_dir

    return cache_dir() / "torch_extensions" / _build_name()


def _build() -> ModuleType | None:
    from torch.utils.cpp_extension import load as load_extension

    directory = build_dir()
    start = time.perf_counter()
    try:  # an unwritable cache falls back like a missing compiler
        directory.mkdir(parents=True, exist_ok=True)
        with _exclusive(directory):
            _remove_stale_baton(directory)
            sources = _sources_in(directory)
            module = load_extension(directory.name, [str(source) for source in sources], extra_cflags=list(CFLAGS),
                                    extra_ldflags=["-fopenmp"], build_directory=str(directory), verbose=False)
    except (OSError, RuntimeError, ImportError) as exc:  # no compiler or ninja: the torch ops serve
        log.warning("CPU kernels unavailable (%s: %s); decode attention takes the torch reference path, the "
                    "layers torch's own ops", type(exc).__name__, str(exc)[:500])
        return None
    log.info("CPU kernels ready in %.1f s (%s)", time.perf_counter() - start, directory)
    return module


@contextlib.contextmanager
def _exclusive(directory: Path):
    """Hold `directory`'s `stepahead.lock` (an `flock`: released by the kernel if this process dies)."""
    with open(directory / "stepahead.lock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another process builds or loads them: said, since a build takes a while
            log.info("waiting for another process to finish building the CPU kernels in %s", directory)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _sources_in(directory: Path) -> list[Path]:
    """Under `_exclusive`: the sources and headers copied into `directory/src` (rewritten only
    where they differ), which the build compiles. Torch's build file holds the sources' absolute
    paths and ninja rebuilds when a command changes, so building from the checkout's own `csrc`
    made every other checkout on the same venv rebuild the shared build directory, and the next
    load from the first one rebuild it again. The copies' paths are the same for every checkout
    of the same sources (the directory is named by their hash)."""
    src = directory / "src"
    src.mkdir(exist_ok=True)
    for path in SOURCES + HEADERS:
        copy = src / path.name
        data = path.read_bytes()
        if not copy.is_file() or copy.read_bytes() != data:
            copy.write_bytes(data)
    return [src / path.name for path in SOURCES]


def _remove_stale_baton(directory: Path) -> None:
    """Under `_exclusive`: remove torch's `lock` file, which only a builder killed mid-way leaves."""
    baton = directory / "lock"
    if baton.exists():
        log.info("removing %s, left by a kernel build that did not finish", baton)
        baton.unlink(missing_ok=True)


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    """The kernel's domain: float32 caches on the CPU."""
    return device.type == "cpu" and dtype == torch.float32


def paged_decode(module: ModuleType, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, window: int | None,
                 softcap: float | None, sinks: torch.Tensor | None, *, vectorized: bool = True) -> torch.Tensor:
    """q `[n, H, d]`, caches `[blocks, block_size, KVH, d]`, block_tables `[n, W]` and seq_lens `[n]`
    int64 -> `[n, H, d]`: each query (position seq_len - 1) over its request's first seq_len keys
    (the last `window` of them), scores soft-capped, sinks `[H]` in the softmax's denominator.
    `vectorized=False` takes the portable loop where the AVX-512 one would run (tests compare them)."""
    args = (q, k_cache, v_cache, block_tables, seq_lens, scale, window or 0, softcap or 0.0,
            q.new_empty(0) if sinks is None else sinks.detach(), vectorized)
    if not torch.autograd.profiler._is_profiler_enabled:  # the range costs more than a small step's kernel
        return module.paged_decode(*args)
    with torch.profiler.record_function("stepahead::paged_decode_cpu"):  # named in profiles (a pybind call)
        return module.paged_decode(*args)


def attach_layer_ops(model: torch.nn.Module, module: ModuleType | None) -> int:
    """Give the model's modules that take the layer kernels (`cpu_ops` declared on their class:
    RMSNorm, the SiLU gated MLP, rotary attention) the built `module` (None: take them back, the
    torch ops again); returns how many modules it set."""
    taken = 0
    for sub in model.modules():
        accepts = getattr(sub, "accepts_cpu_ops", None)
        if accepts is not None and accepts():
            sub.cpu_ops = module
            taken += 1
    return taken


def layer_ops(module: torch.nn.Module, x: torch.Tensor) -> ModuleType | None:
    """`module`'s layer kernels when they take `x`: attached, float32 on the CPU, and not while
    torch.compile traces (checked first, so dynamo sees a constant and never the kernels)."""
    if torch.compiler.is_compiling():
        return None
    ops = module.cpu_ops
    if ops is None or x.dtype != torch.float32 or not x.is_cpu:  # is_cpu: no device object per call
        return None
    return ops
