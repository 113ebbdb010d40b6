"""Per-request worker state and the step's flattened inputs, built in persistent buffers.

Host arrays are numpy views of (pinned, on CUDA) torch tensors; the device copies live in
persistent device tensors that grow geometrically and are reused across steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from stepahead.plan import SamplingParams
from worker_service.attention import AttentionMetadata


@dataclass
class CachedRequest:
    """What the worker remembers about a request between steps."""

    request_id: str
    token_ids: list[int]  # every token the worker knows: prompt (+ resumed output) + sampled
    sampling: SamplingParams
    block_ids: list[int]
    num_computed: int
    num_prompt_tokens: int = 0  # token_ids[:num_prompt_tokens] is the prompt

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class ScheduledRequest:
    state: CachedRequest
    num_scheduled: int
    placeholder: bool  # input token comes from the previous step's device-side sampled ids


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64 on device
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampling] int64: rows of the hidden states to sample
    sampling_reqs: list[CachedRequest]  # in logits row order
    placeholder_dst: torch.Tensor  # [num_placeholders] token index in input_ids
    placeholder_src: torch.Tensor  # [num_placeholders] row in the previous step's sampled ids


class _Buffer:
    """A growable 1-D or 2-D int64 buffer: host numpy view + device tensor."""

    def __init__(self, device: torch.device, cols: int | None = None):
        self.device, self.cols = device, cols
        self.host_t = self.dev = None
        self.host = np.empty(0, dtype=np.int64)

    def ensure(self, rows: int, cols: int | None = None) -> np.ndarray:
        shape = (rows,) if self.cols is None else (rows, max(cols or 1, 1))
        if self.host_t is None or any(s > c for s, c in zip(shape, self.host_t.shape)):
            cap = tuple(max(16, 1 << (s - 1).bit_length()) for s in shape)
            self.host_t = torch.zeros(cap, dtype=torch.int64, pin_memory=self.device.type == "cuda")
            self.host = self.host_t.numpy()
            same = self.device.type == "cpu"
            self.dev = self.host_t if same else torch.zeros(cap, dtype=torch.int64, device=self.device)
        return self.host[tuple(slice(0, s) for s in shape)]

    def to_device(self, view: np.ndarray) -> torch.Tensor:
        idx = tuple(slice(0, s) for s in view.shape)
        if self.dev is self.host_t:
            return self.dev[idx]
        dst = self.dev[idx]
        dst.copy_(self.host_t[idx], non_blocking=True)
        return dst


class StepBuffers:
    def __init__(self, device: torch.device):
        names = ("input_ids", "positions", "slots", "seq_lens", "logits_idx", "ph_dst", "ph_src", "pf_rows")
        self.bufs = {n: _Buffer(device) for n in names}
        self.bufs["pf_index"] = _Buffer(device, cols=1)
        self.bufs["tables"] = _Buffer(device, cols=1)


def build_inputs(buffers: StepBuffers, sched: list[ScheduledRequest], block_size: int,
                 prev_rows: dict[str, int]) -> StepInputs:
    """Flatten `sched` (decodes, i.e. one-token queries, must come first) into device inputs."""
    b = buffers.bufs
    num_reqs = len(sched)
    q_lens = np.fromiter((s.num_scheduled for s in sched), dtype=np.int64, count=num_reqs)
    starts = np.fromiter((s.state.num_computed for s in sched), dtype=np.int64, count=num_reqs)
    num_tokens = int(q_lens.sum())
    max_blocks = max(len(s.state.block_ids) for s in sched)
    tables = b["tables"].ensure(num_reqs, max_blocks)
    tables.fill(0)
    ids = b["input_ids"].ensure(num_tokens)
    cu = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu[1:])
    for i, s in enumerate(sched):  # one slice copy per request, no per-token Python
        st = s.state
        tables[i, : len(st.block_ids)] = st.block_ids
        ids[cu[i] : cu[i + 1]] = st.token_ids[st.num_computed : st.num_computed + s.num_scheduled]
    req_of_token = np.repeat(np.arange(num_reqs), q_lens)  # [num_tokens]
    positions = b["positions"].ensure(num_tokens)
    positions[:] = np.arange(num_tokens) - cu[req_of_token] + starts[req_of_token]
    slots = b["slots"].ensure(num_tokens)
    slots[:] = tables[req_of_token, positions // block_size] * block_size + positions % block_size
    seq_lens = b["seq_lens"].ensure(num_reqs)
    seq_lens[:] = starts + q_lens
    sampling_rows = [i for i, s in enumerate(sched) if seq_lens[i] == len(s.state.token_ids)]
    logits_idx = b["logits_idx"].ensure(len(sampling_rows))
    logits_idx[:] = cu[1:][sampling_rows] - 1
    ph_rows = [i for i, s in enumerate(sched) if s.placeholder]
    ph_dst = b["ph_dst"].ensure(len(ph_rows))
    ph_dst[:] = cu[ph_rows]
    ph_src = b["ph_src"].ensure(len(ph_rows))
    ph_src[:] = [prev_rows[sched[i].state.request_id] for i in ph_rows]
    num_decodes = int(np.argmax(q_lens != 1)) if (q_lens != 1).any() else num_reqs
    meta = AttentionMetadata(
        slot_mapping=b["slots"].to_device(slots),
        positions=b["positions"].to_device(positions),
        block_tables=b["tables"].to_device(tables),
        seq_lens=b["seq_lens"].to_device(seq_lens),
        num_decodes=num_decodes,
        max_decode_kv=int(seq_lens[:num_decodes].max()) if num_decodes else 0,
        decode_uniform=bool(num_decodes) and bool(seq_lens[:num_decodes].min() == seq_lens[:num_decodes].max()),
        max_prefill_kv=int(seq_lens[num_decodes:].max()) if num_decodes < num_reqs else 0,
        **_prefill_index(b, cu, q_lens, num_decodes),
    )
    return StepInputs(
        input_ids=b["input_ids"].to_device(ids),
        meta=meta,
        logits_indices=b["logits_idx"].to_device(logits_idx),
        sampling_reqs=[sched[i].state for i in sampling_rows],
        placeholder_dst=b["ph_dst"].to_device(ph_dst),
        placeholder_src=b["ph_src"].to_device(ph_src),
    )


def _prefill_index(b: dict[str, _Buffer], cu: np.ndarray, q_lens: np.ndarray, num_decodes: int) -> dict:
    """Padded `[num_prefills, max_q]` token indices of the prompt-chunk requests."""
    pf_lens = q_lens[num_decodes:]
    num_p = len(pf_lens)
    max_q = int(pf_lens.max()) if num_p else 0
    index = b["pf_index"].ensure(num_p, max_q)
    rows = b["pf_rows"].ensure(int(pf_lens.sum()))
    if num_p:
        offs = np.arange(max_q)[None, :]  # [1, max_q]
        # padded entries repeat the request's last token so no query row is fully masked
        index[:] = cu[num_decodes:-1, None] + np.minimum(offs, pf_lens[:, None] - 1)
        rows[:] = np.flatnonzero(offs < pf_lens[:, None])  # real entries, row-major = token order
    return {
        "prefill_token_index": b["pf_index"].to_device(index),
        "prefill_rows": b["pf_rows"].to_device(rows),
    }
