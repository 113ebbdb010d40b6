"""Values of `--attention-backend` (torch-free, so the worker's config parses without torch)."""

from __future__ import annotations

import enum


class AttentionBackendName(enum.Enum):
    AUTO = "auto"  # CPU float32: the C++ paged-decode kernel (torch's path for prompts); CUDA graphs: paged; else torch
    TORCH = "torch"  # reference: gathers up to the step's longest decode (a host scalar)
    PAGED = "paged"  # device-side decode metadata, bucketed shapes; flash-attn when usable
    FLASHINFER = "flashinfer"  # CUDA, flashinfer-python installed: its paged decode and prefill kernels
