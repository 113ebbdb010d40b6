"""Raw logprobs on the device: the sampled token's, the top k, and prompt logprobs (`echo`).

Everything is the log-softmax of the model's *raw* logits (before logit bias, penalties,
the min_tokens stop mask, temperature and truncation; vLLM's default "raw logprobs"),
computed on the device for the rows that ask only, and copied to the host with the sampled
ids (pinned, non-blocking, on the output stream; `PendingStep.wait()` reads them after the
step's one synchronisation).

Costs: a step where no live request asks pays one integer test (`Logprobs.begin_step`
returns None); a mixed step computes a log-softmax over its asking rows only.

Prompt logprobs follow chunked prefill: a chunk computing positions `[s, s + n)` returns the
logprobs of prompt positions `s + 1 ... min(s + n, P - 1)` (each predicted by the position
before it), so each chunk returns its own part. A recomputed request (preemption) returns
them again; the scheduler forwards only positions it has not delivered yet
(`PromptLogprobs.after`). Top-k ties come out in `torch.topk` order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from stepahead.logprobs import Logprobs, PromptLogprobs
from worker_service.input_batch import CachedRequest, ScheduledBatch
from worker_service.streams import host_to_device

_PROMPT_ROWS_PER_PASS = 512  # bounds the [rows, vocab] float32 logits of a long prompt chunk


class _DeviceRows:
    """Logprobs of m positions on the device: own token's [m], top ids [m, k], top values [m, k]."""

    def __init__(self, own: torch.Tensor, top_ids: torch.Tensor, top_lp: torch.Tensor) -> None:
        self.own, self.top_ids, self.top_lp = own, top_ids, top_lp
        self.host: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def to_host(self, pinned: bool) -> None:
        """Start the D2H copies (call on the output stream after it waited for compute)."""
        self.host = tuple(_pinned_copy(t, pinned) for t in (self.own, self.top_ids, self.top_lp))

    def rows(self, token_ids: list[int], ks: list[int]) -> list[Logprobs]:
        """After the step's synchronisation: one `Logprobs` per row (top trimmed to its k)."""
        own, top_ids, top_lp = (t.tolist() for t in self.host)
        return [Logprobs(t, lp, tuple(zip(ids[:k], vals[:k])))
                for t, lp, ids, vals, k in zip(token_ids, own, top_ids, top_lp, ks)]


def _pinned_copy(t: torch.Tensor, pinned: bool) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned)
    host.copy_(t, non_blocking=pinned)
    return host


def _log_softmax_rows(logits: torch.Tensor, targets: torch.Tensor, k: int) -> _DeviceRows:
    """logits [m, vocab] → logprobs of `targets` [m] and the top k of each row."""
    lp = logits.float().log_softmax(dim=-1)  # [m, vocab]
    own = lp.gather(-1, targets[:, None]).squeeze(-1)  # [m]
    top = lp.topk(k, dim=-1)  # values, indices: [m, k] descending
    return _DeviceRows(own, top.indices, top.values)


class StepLogprobs:
    """One step's logprob work: raw sampling rows, then prompt chunks, then the host copy."""

    def __init__(self, device: torch.device, prompt_chunks: list[tuple[CachedRequest, int, int, int]]) -> None:
        self.device = device
        self._prompt_chunks = prompt_chunks  # (request, token offset in the step, first position, count)
        self._prompt: list[_DeviceRows] = []  # one per pass of at most _PROMPT_ROWS_PER_PASS rows
        self._prompt_owners: list[tuple[CachedRequest, int, int]] = []  # (request, first position, count)
        self._raw: torch.Tensor | None = None  # [m, vocab] float32 log-softmax of the asking rows
        self._raw_rows: list[int] = []  # their rows in the step's sampling batch
        # one part per sampling pass that succeeded (several when the step's requests were
        # retried one by one): (rows, their requests, their tokens [m] on the device, then the host)
        self._runs: list[tuple[_DeviceRows, list[CachedRequest], torch.Tensor]] = []

    # -- on the compute stream --------------------------------------------------------------

    def prompt(self, hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """hidden [num_tokens, hidden]: logprobs of the prompt tokens these chunks predict."""
        index, targets, owners = [], [], []
        for req, offset, start, count in self._prompt_chunks:
            index += range(offset, offset + count)
            targets += req.token_ids[start + 1 : start + 1 + count]
            owners.append((req, start + 1, count))
        k = max([req.sampling.prompt_logprobs for req, *_ in self._prompt_chunks] + [1])
        for lo in range(0, len(index), _PROMPT_ROWS_PER_PASS):
            idx = host_to_device(index[lo : lo + _PROMPT_ROWS_PER_PASS], torch.int64, self.device)  # [t]
            tgt = host_to_device(targets[lo : lo + _PROMPT_ROWS_PER_PASS], torch.int64, self.device)  # [t]
            logits = compute_logits(hidden.index_select(0, idx))  # [t, vocab]
            self._prompt.append(_log_softmax_rows(logits, tgt, k))
        self._prompt_owners = owners

    def raw(self, logits: torch.Tensor, reqs: list[CachedRequest]) -> None:
        """logits [n, vocab] of the sampling rows, before any processing: keep the asking rows' log-softmax."""
        self._raw, self._raw_rows = None, []  # a failed pass before this one leaves nothing behind
        rows = [i for i, r in enumerate(reqs) if r.sampling.logprobs is not None]
        if rows:
            self._raw_rows = rows
            self._raw = logits.index_select(0, host_to_device(rows, torch.int64, self.device)).float().log_softmax(-1)

    def sampled(self, sampled: torch.Tensor, reqs_in: list[CachedRequest], reqs_out: list[CachedRequest]) -> None:
        """sampled [len(reqs_out)]: ids of the requests that sampled (reqs_out ⊆ reqs_in, in order)."""
        if self._raw is None:
            return
        out_row = {r.request_id: i for i, r in enumerate(reqs_out)}
        keep = [(j, out_row[reqs_in[i].request_id]) for j, i in enumerate(self._raw_rows)
                if reqs_in[i].request_id in out_row]
        if not keep:
            return
        lp_rows, id_rows = (host_to_device(list(c), torch.int64, self.device) for c in zip(*keep))
        lp = self._raw.index_select(0, lp_rows)  # [m, vocab]
        tokens = sampled.index_select(0, id_rows)  # [m]
        k = max(max(reqs_out[i].sampling.logprobs for _, i in keep), 1)
        top = lp.topk(k, dim=-1)
        self._runs.append((_DeviceRows(lp.gather(-1, tokens[:, None]).squeeze(-1), top.indices, top.values),
                           [reqs_out[i] for _, i in keep], tokens))
        self._raw = None

    def raw_verified(self, logits: torch.Tensor, reqs: list[CachedRequest], row_req: list[int]) -> None:
        """A speculative step: logits [rows, vocab] of every verified position, before any
        processing; `row_req[row]` is the row's request in `reqs`. Keeps the asking rows'."""
        self.raw(logits, [reqs[i] for i in row_req])

    def emitted(self, row_tokens: torch.Tensor, reqs: list[CachedRequest], row_req: list[int]) -> None:
        """A speculative step: row_tokens [rows] int64, the token each verified position emits
        (-1 past the accepted run; those rows are dropped on the host)."""
        if self._raw is None:
            return
        rows = self._raw_rows
        tokens = row_tokens.index_select(0, host_to_device(rows, torch.int64, self.device))  # [m]
        owners = [reqs[row_req[r]] for r in rows]
        k = max(max(r.sampling.logprobs for r in owners), 1)
        top = self._raw.topk(k, dim=-1)
        own = self._raw.gather(-1, tokens.clamp(min=0)[:, None]).squeeze(-1)  # [m]
        self._runs.append((_DeviceRows(own, top.indices, top.values), owners, tokens))
        self._raw = None

    def to_host(self, pinned: bool) -> None:
        """Start every D2H copy of this step (on the output stream)."""
        for i, (rows, reqs, tokens) in enumerate(self._runs):
            rows.to_host(pinned)
            self._runs[i] = (rows, reqs, _pinned_copy(tokens, pinned))
        for rows in self._prompt:
            rows.to_host(pinned)

    # -- on the host, after the step's synchronisation -----------------------------------------

    def collect(self, failed: dict[str, str]) -> tuple[dict[str, list[Logprobs]], dict[str, PromptLogprobs]]:
        """(per request, the logprobs of each token it emitted this step, in order: a plain
        step's one, a speculative step's accepted drafts then sampled token; the prompt logprobs)."""
        return self._collect_runs(), self._collect_prompt(failed)

    def _collect_runs(self) -> dict[str, list[Logprobs]]:
        runs: dict[str, list[Logprobs]] = {}
        for rows, reqs, host_tokens in self._runs:
            tokens = host_tokens.tolist()
            entries = rows.rows(tokens, [r.sampling.logprobs for r in reqs])
            for r, t, e in zip(reqs, tokens, entries):  # a speculative step's rows are in run order
                if t >= 0:
                    runs.setdefault(r.request_id, []).append(e)
        return runs

    def _collect_prompt(self, failed: dict[str, str]) -> dict[str, PromptLogprobs]:
        if not self._prompt:
            return {}
        ks = [req.sampling.prompt_logprobs for req, _, count in self._prompt_owners for _ in range(count)]
        targets = [t for req, start, count in self._prompt_owners for t in req.token_ids[start : start + count]]
        flat: list[Logprobs] = []
        for lo, rows in zip(range(0, len(ks), _PROMPT_ROWS_PER_PASS), self._prompt):
            flat += rows.rows(targets[lo : lo + _PROMPT_ROWS_PER_PASS], ks[lo : lo + _PROMPT_ROWS_PER_PASS])
        out, pos = {}, 0
        for req, start, count in self._prompt_owners:
            if req.request_id not in failed:
                out[req.request_id] = PromptLogprobs(start, tuple(flat[pos : pos + count]))
            pos += count
        return out


class LogprobsTracker:
    """Counts the live requests that ask, so a step without any pays nothing."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._asking = 0

    def register(self, req: CachedRequest) -> None:
        self._asking += _asks(req)

    def forget(self, req: CachedRequest) -> None:
        self._asking -= _asks(req)

    def begin_step(self, sched: ScheduledBatch) -> StepLogprobs | None:
        """Before the step's `num_computed` advance: None when no live request asks."""
        if not self._asking:
            return None
        chunks, offset = [], 0
        for req, n in zip(sched.states, sched.num_scheduled):
            if req.sampling.prompt_logprobs is not None:
                start = req.num_computed
                count = min(start + n, req.num_prompt_tokens - 1) - start  # positions predicting prompt tokens
                if count > 0:
                    chunks.append((req, offset, start, count))
            offset += n
        return StepLogprobs(self.device, chunks)


def _asks(req: CachedRequest) -> bool:
    return req.sampling.logprobs is not None or req.sampling.prompt_logprobs is not None
