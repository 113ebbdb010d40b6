"""Values of `--attention-backend` (torch-free, so the worker's config parses without torch)."""

from __future__ import annotations

import enum


class AttentionBackendName(enum.Enum):
    TORCH = "torch"  # reference: gathers up to the step's longest decode (a host scalar)
    PAGED = "paged"  # device-side decode metadata, bucketed shapes; flash-attn when usable
