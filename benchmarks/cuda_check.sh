#!/usr/bin/env bash
# The CUDA checks in one call, for a lent GPU machine (at most 9 minutes of timeouts: one device call):
#   the gpu-marked tests (incl. the wait-removal table and the decode CUDA graphs), the CUDA step
#   benchmark (eager, compiled and graphed, against the HBM roofline), and the host-work benchmark on
#   that machine's CPU. Results go to $OUT when set (the device tool's output folder), else
#   benchmarks/results/. Run from the repository root:
#       bash benchmarks/cuda_check.sh
set -u -o pipefail
OUT_DIR=${OUT:-benchmarks/results}
mkdir -p "$OUT_DIR"
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
status=0

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  $PY -c "import flash_attn; print('flash_attn', flash_attn.__version__)" 2>/dev/null || echo "flash_attn: not installed"
  $PY -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>/dev/null || echo "flashinfer: not installed"
} > "$OUT_DIR/cuda_env.txt" 2>&1
cat "$OUT_DIR/cuda_env.txt"

# 1. gpu tests: the runner's CUDA path, the wait table, decode CUDA graphs (graphed = eager bit for bit,
#    back to back with a slowed stream), the seeded sampler on CUDA
timeout 240 $PY -m pytest -q -p no:cacheprovider -rA -m gpu tests/gpu tests/model/test_sampler.py \
    2>&1 | tee "$OUT_DIR/cuda_gpu_tests.txt" || status=1

# 2. decode steps on the device: synchronous vs pipelined launches, torch vs paged decode, eager vs
#    compiled (each decoder layer through torch.compile: Triton) vs CUDA graphs, against the HBM roofline
timeout 70 $PY benchmarks/cuda_steps.py --device cuda --dtype bfloat16 --models tiny 100m \
    --backends torch paged flashinfer --batches 64 256 --steps 50 --out "$OUT_DIR/cuda_steps.json" 2>&1 \
    | tee "$OUT_DIR/cuda_steps.txt" || status=1
timeout 180 $PY benchmarks/cuda_steps.py --device cuda --dtype bfloat16 --models 100m --backends paged \
    --batches 1 8 64 --steps 30 --modes eager graphs compiled compiled+graphs \
    --out "$OUT_DIR/cuda_steps_graphs.json" 2>&1 | tee "$OUT_DIR/cuda_steps_graphs.txt" || status=1

# 3. host work per step on this machine's CPU (what the GPU waits for)
timeout 30 $PY benchmarks/host_work.py --iters 200 --out "$OUT_DIR/host_work_gpu_host.json" \
    2>&1 | tee "$OUT_DIR/host_work_gpu_host.txt" || status=1
exit $status
