"""Logit bias and repetition / presence / frequency penalties, on the device.

Applied to the raw logits of the sampling rows, before temperature and truncation, in
vLLM's order and scopes: `logit_bias` first; then repetition over the request's prompt and
output tokens (positive logits divided by the penalty, negative ones multiplied: the
Hugging Face / CTRL rule); then frequency (times the count) and presence (once) over the
output tokens only.

The token counts live on the device (`PenaltyState`: one row per request that uses
penalties), and `record` adds each step's sampled ids to them *on the device*, right
after sampling. A step launched before the previous step's ids reached the host (a
placeholder decode under async scheduling) therefore already penalises the previous
token: async and sync scheduling give identical tokens. A request that arrives (or comes
back after preemption) with output tokens has its counts rebuilt from its token list.

A batch where no row uses a feature pays nothing for it: `apply` returns before touching
the device when no row has a bias or a penalty.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from stepahead.plan import SamplingParams
from worker_service.streams import host_to_device  # no blocking H2D: the host never waits for the device


class PenaltyState:
    """Per-request prompt-token masks and output-token counts: `[slots, vocab]` on the device."""

    def __init__(self, vocab_size: int, device: torch.device, initial_slots: int = 8) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.counts = torch.zeros(initial_slots, vocab_size, dtype=torch.int32, device=device)  # [slots, vocab]
        self.in_prompt = torch.zeros(initial_slots, vocab_size, dtype=torch.bool, device=device)  # [slots, vocab]
        self.slots: dict[str, int] = {}  # request id -> row
        self._free: list[int] = list(range(initial_slots - 1, -1, -1))

    def register(self, request_id: str, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """Start (or restart, after preemption) tracking a request from its known tokens."""
        self.forget(request_id)
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self.slots[request_id] = slot
        self.in_prompt[slot].zero_()
        self.counts[slot].zero_()
        if prompt_ids:
            self.in_prompt[slot, host_to_device(list(prompt_ids), torch.int64, self.device)] = True
        if output_ids:
            ids = host_to_device(list(output_ids), torch.int64, self.device)
            self.counts[slot].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))

    def forget(self, request_id: str) -> None:
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def _grow(self) -> None:
        old = self.counts.shape[0]
        self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])  # [2 * slots, vocab]
        self.in_prompt = torch.cat([self.in_prompt, torch.zeros_like(self.in_prompt)])
        self._free.extend(range(2 * old - 1, old - 1, -1))

    def record(self, rows: torch.Tensor, slots: torch.Tensor, sampled: torch.Tensor) -> None:
        """counts[slots[i], sampled[rows[i]]] += 1, on the device (no host round trip).

        rows, slots: [m] int64 on the device; sampled: [n] int64 this step's ids.
        """
        ids = sampled.index_select(0, rows)  # [m]
        self.counts.index_put_((slots, ids), torch.ones_like(ids, dtype=torch.int32), accumulate=True)


class LogitsProcessing:
    """Applies bias and penalties to a step's sampling rows, and records sampled ids."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.state = PenaltyState(vocab_size, device)
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None  # rows, slots of this step

    def register(self, request_id: str, sampling: SamplingParams, token_ids: Sequence[int], num_prompt: int) -> None:
        if sampling.uses_penalties:
            self.state.register(request_id, token_ids[:num_prompt], token_ids[num_prompt:])

    def forget(self, request_id: str) -> None:
        self.state.forget(request_id)

    def apply(self, logits: torch.Tensor, request_ids: Sequence[str], params: Sequence[SamplingParams],
              preceding: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        """logits [n, vocab] with bias and penalties applied: `logits` itself when no row uses
        them, else a new tensor (the input stays intact, so a retry starts clean).
        Remembers the penalty rows for `record`. `preceding[i]`: output tokens row i comes
        after that the device counts do not hold yet (a speculative row's earlier drafts)."""
        self._pending = None
        biased = [i for i, p in enumerate(params) if p.logit_bias]
        penalised = [i for i, p in enumerate(params) if p.uses_penalties]
        if not (biased or penalised):
            return logits
        logits = logits.clone()  # [n, vocab]
        if biased:
            self._apply_bias(logits, biased, params)
        if penalised:
            extra = [preceding[i] for i in penalised] if preceding is not None else None
            self._apply_penalties(logits, penalised, [request_ids[i] for i in penalised], params, extra)
        return logits

    def record(self, sampled: torch.Tensor) -> None:
        """Add this step's sampled ids [n] to the counts of its penalty rows (device only)."""
        if self._pending is not None:
            self.state.record(*self._pending, sampled)
            self._pending = None

    def _apply_bias(self, logits: torch.Tensor, rows: list[int], params: Sequence[SamplingParams]) -> None:
        index_rows, cols, values = [], [], []
        for i in rows:
            for token_id, bias in params[i].logit_bias:
                index_rows.append(i)
                cols.append(token_id)
                values.append(bias)
        index = (host_to_device(index_rows, torch.int64, self.device), host_to_device(cols, torch.int64, self.device))
        logits.index_put_(index, host_to_device(values, logits.dtype, self.device), accumulate=True)

    def record_runs(self, request_ids: Sequence[str], tokens: torch.Tensor, num_tokens: torch.Tensor) -> None:
        """Add each request's first num_tokens[i] tokens[i] to its counts, on the device.

        tokens: [n, m] int64 (-1 padded); num_tokens: [n] int64; rows without penalties skip."""
        self._pending = None
        rows = [i for i, rid in enumerate(request_ids) if rid in self.state.slots]
        if not rows:
            return
        index = host_to_device(rows, torch.int64, self.device)  # [p]
        slots = host_to_device([self.state.slots[request_ids[i]] for i in rows], torch.int64, self.device)  # [p]
        toks = tokens.index_select(0, index)  # [p, m]
        valid = torch.arange(toks.shape[1], device=toks.device)[None, :] < num_tokens.index_select(0, index)[:, None]
        self.state.counts.index_put_((slots[:, None].expand_as(toks), toks.clamp(min=0)), valid.to(torch.int32),
                                     accumulate=True)

    def _apply_penalties(self, logits: torch.Tensor, rows: list[int], request_ids: list[str],
                         params: Sequence[SamplingParams], preceding: list[Sequence[int]] | None = None) -> None:
        slots_list = [self.state.slots[rid] for rid in request_ids]
        host = torch.tensor([[params[i].repetition_penalty, params[i].frequency_penalty, params[i].presence_penalty]
                             for i in rows], dtype=torch.float32)  # [m, 3]
        rep, freq, pres = host_to_device(host, torch.float32, self.device).unbind(1)  # [m] each
        rows_t = host_to_device(rows, torch.int64, self.device)  # [m]
        slots = host_to_device(slots_list, torch.int64, self.device)  # [m]
        counts = self.state.counts.index_select(0, slots)  # [m, vocab] int32
        if preceding is not None and any(preceding):
            pairs = [(m, t) for m, toks in enumerate(preceding) for t in toks]  # (row in counts, token)
            at = host_to_device(pairs, torch.int64, self.device)  # [p, 2]
            counts.index_put_((at[:, 0], at[:, 1]), torch.ones(len(pairs), dtype=torch.int32, device=self.device),
                              accumulate=True)
        seen = counts > 0  # [m, vocab]
        x = logits.index_select(0, rows_t)  # [m, vocab]
        repeated = seen | self.state.in_prompt.index_select(0, slots)  # [m, vocab]
        penalised = torch.where(x > 0, x / rep[:, None], x * rep[:, None])  # [m, vocab]
        x = torch.where(repeated, penalised, x)
        x = x - freq[:, None] * counts.to(x.dtype) - pres[:, None] * seen.to(x.dtype)
        logits.index_copy_(0, rows_t, x)
        self._pending = (rows_t, slots)


def mask_stops_before_min_tokens(logits: torch.Tensor, reqs: Sequence, eos_token_ids: Sequence[int],
                                 rows: Sequence[tuple[int, int]] | None = None) -> torch.Tensor:
    """logits [num_rows, vocab] with logits[row, stop ids] = -inf for rows whose request is still
    short of min_tokens: a new tensor when a row is masked, `logits` itself otherwise (the input
    stays intact, so a retry request by request starts from the raw logits).

    `rows`: per logits row, (index into `reqs`, tokens the row comes after beyond the
    request's output: a speculative step's j-th verified position); default one row per
    request at its output length. The flat indices go up from pinned memory without
    blocking: a pageable `torch.tensor(..., device=cuda)` would make the host wait.
    """
    vocab = logits.shape[1]  # logits: [num_rows, vocab] contiguous
    flat = []
    for row, (i, j) in enumerate(rows if rows is not None else ((i, 0) for i in range(len(reqs)))):
        r = reqs[i]
        if r.num_output_tokens + j < r.sampling.min_tokens:
            stops = set(r.sampling.stop_token_ids)
            if not r.sampling.ignore_eos:
                stops.update(eos_token_ids)
            flat += [row * vocab + t for t in stops if 0 <= t < vocab]
    if not flat:
        return logits
    index = host_to_device(flat, torch.int64, logits.device)  # [num_masked] row * vocab + token
    return logits.contiguous().view(-1).index_fill(0, index, float("-inf")).view(logits.shape)
