"""The worker's side of n-gram speculative decoding (docs/speculative-decoding.md).

Per step: `Speculator.propose` drafts tokens for each decode the plan allows drafts
(n-gram lookup over every token the worker knows: the previous step was resolved first),
appending them to the request's token list while the inputs are built (`strip` takes them
off again); the forward computes 1 + k positions; `verify` turns the k + 1 logits rows of
each request into its accepted run in one pass on the device, and `SpecOutputs.resolve`
applies the run on the host once its D2H copy completed.

Verification per request with drafts d_1..d_k (row j predicts the token after d_j):
- every row gets exactly the processing a normal sample would at that length: min_tokens
  stop masks, bias, penalties counting d_1..d_j as output, the grammar mask after d_1..d_j
  (structured outputs: drafts were cut at the first token the grammar refuses), temperature,
  top-k/p, min-p;
- greedy rows accept d_{j+1} iff it is the row's argmax;
- sampled rows accept d_{j+1} with probability p_j(d_{j+1}) (vLLM V1's rejection sampling
  with a one-hot draft distribution); the first rejected row samples from p_j with d_{j+1}
  removed (renormalised); if all k are accepted, row k samples the bonus token.
- seeded rows: the acceptance uniform is a hash of (seed ^ ACCEPT_SALT, tokens held), the
  draw uniform the usual (seed, tokens held): a row with no drafts samples exactly what the
  normal sampler would.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from stepahead.plan import RunningRequest, SpecOutcome, StepPlan
from stepahead.speculative import SpeculativeConfig
from worker_service.grammar import GrammarMasks
from worker_service.input_batch import CachedRequest
from worker_service.logits_processing import mask_stops_before_min_tokens
from worker_service.logprobs import StepLogprobs
from worker_service.ngram import propose_ngram
from worker_service.sampler import SamplingMetadata, inverse_cdf_sample, seeded_uniforms
from worker_service.streams import host_to_device

ACCEPT_SALT = 0x5BEC_DEC0_DE5A_17ED  # seeds of acceptance draws differ from those of sampling draws
_NEG_INF = float("-inf")


@dataclass
class SpecOutputs:
    """A launched speculative step's results on their way to the host."""

    host: torch.Tensor  # [n, 2 + K] int64: column 0 = tokens produced, then the tokens (-1 padded)
    num_drafts: list[int]  # per sampling row: drafts proposed (0 for rows without)
    allowed: list[bool]  # per sampling row: the plan allowed drafts (an outcome is reported)

    @staticmethod
    def concat(parts: list[SpecOutputs], device: torch.device) -> SpecOutputs:
        """The outputs of a step verified in several passes (its requests retried one by one),
        in row order; each part's host [n_i, 2 + K_i] is padded with -1 to the widest."""
        if not parts:
            return SpecOutputs(torch.zeros(0, 2, dtype=torch.int64, device=device), [], [])
        width = max(p.host.shape[1] for p in parts)
        host = torch.cat([torch.nn.functional.pad(p.host, (0, width - p.host.shape[1]), value=-1)
                          for p in parts])  # [n, width]
        return SpecOutputs(host, [k for p in parts for k in p.num_drafts], [a for p in parts for a in p.allowed])

    def resolve(self, reqs: list[CachedRequest], slots: list[int]) -> tuple[list[int], dict[str, SpecOutcome]]:
        """Write each request's run into its token list (replacing its reserved slot), roll its
        num_computed back past rejected drafts; returns the sampled (last) ids and the outcomes."""
        rows = self.host.tolist()
        last, outcomes = [], {}
        for r, slot, row, k, allowed in zip(reqs, slots, rows, self.num_drafts, self.allowed):
            run = row[1 : 1 + row[0]]
            r.token_ids[slot : slot + 1] = run
            r.num_computed -= k - (len(run) - 1)
            last.append(run[-1])
            if allowed:
                outcomes[r.request_id] = SpecOutcome(k, tuple(run[:-1]))
        return last, outcomes


@dataclass
class SpecBatch:
    """This step's drafts, keyed by request id."""

    drafts: dict[str, list[int]] = field(default_factory=dict)  # requests allowed drafts (maybe none proposed)


class Speculator:
    def __init__(self, config: SpeculativeConfig, eos_token_ids: tuple[int, ...],
                 grammar: GrammarMasks | None = None) -> None:
        self.config = config
        self.eos_token_ids = eos_token_ids
        self.grammar = grammar  # structured outputs: drafts are cut to what the grammar allows
        self.batch: SpecBatch | None = None  # the step being launched

    def resolve_before(self, plan: StepPlan, pending: list) -> None:
        """Drafts are proposed from every token of a request: before a step with drafts, or
        after one (whose acceptance moves the next positions), wait for the unreported steps'
        tokens (`PendingStep.ids`: one host synchronisation)."""
        live = [p for p in pending if p is not None]
        if any(p.spec is not None for p in live) or any(r.num_draft_tokens for r in plan.running):
            for p in live:
                p.ids()

    def draft(self, state: CachedRequest, r: RunningRequest) -> tuple[int, bool]:
        """(tokens to compute, input is a placeholder) of a decode the plan allows drafts."""
        if state.token_ids[-1] < 0:  # not resolved (cannot happen after resolve_before): plain decode
            return 1, r.input_is_placeholder
        return self.propose(state, r.num_draft_tokens), False

    def propose(self, state: CachedRequest, allowed: int) -> int:
        """Append up to `allowed` drafts to the state's tokens; returns the tokens to compute."""
        cfg = self.config
        drafts = propose_ngram(state.token_ids, min(allowed, cfg.num_speculative_tokens),
                               cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        if self.grammar is not None:
            drafts = self.grammar.cut_drafts(state, drafts)
        if self.batch is None:
            self.batch = SpecBatch()
        self.batch.drafts[state.request_id] = drafts
        state.token_ids.extend(drafts)
        return 1 + len(drafts)

    def end_proposals(self) -> None:
        """No draft proposed this step: it runs (and samples) as a plain step."""
        if self.batch is not None and not any(self.batch.drafts.values()):
            self.batch = None

    def strip(self, states: list[CachedRequest]) -> None:
        """Take the drafts off the token lists again (the inputs are built)."""
        if self.batch is None:
            return
        for st in states:
            k = len(self.batch.drafts.get(st.request_id, ()))
            if k:
                del st.token_ids[-k:]

    def logits_indices(self, sampling_reqs: list[CachedRequest], last_index: torch.Tensor) -> torch.Tensor:
        """[rows] int64: every verified position of each sampling request, in row order.
        `last_index`: [n] each request's last scheduled token (its normal sampling row)."""
        ks = [len(self.batch.drafts.get(r.request_id, ())) for r in sampling_reqs]
        offsets = [j - k for k in ks for j in range(k + 1)]  # [rows]: position relative to the last
        repeat = host_to_device(ks, torch.int64, last_index.device) + 1  # [n]
        base = last_index.repeat_interleave(repeat, output_size=len(offsets))  # [rows]
        return base + host_to_device(offsets, torch.int64, last_index.device)

    def verify(self, runner, logits: torch.Tensor, reqs: list[CachedRequest], step_lp: StepLogprobs | None = None
               ) -> tuple[torch.Tensor, SpecOutputs]:
        """logits [rows, vocab] (rows as `logits_indices`) → (last ids [n], the step's outputs);
        `step_lp` (a request asks for logprobs) gets every verified position's raw logprobs."""
        drafts = [self.batch.drafts.get(r.request_id, []) for r in reqs]
        ks = [len(d) for d in drafts]
        kmax = max(ks, default=0)
        row_req = [i for i, k in enumerate(ks) for _ in range(k + 1)]  # [rows] request of each row
        row_j = [j for k in ks for j in range(k + 1)]  # [rows] drafts before the row
        if step_lp is not None:  # raw logprobs: before the stop mask, bias and penalties
            step_lp.raw_verified(logits, reqs, row_req)
        # EOS / stop ids -inf on rows short of min_tokens, earlier drafts counted
        logits = mask_stops_before_min_tokens(logits, reqs, self.eos_token_ids, list(zip(row_req, row_j)))
        params = [reqs[i].sampling for i in row_req]
        ntok = [len(reqs[i].token_ids) + j for i, j in zip(row_req, row_j)]
        preceding = [drafts[i][:j] for i, j in zip(row_req, row_j)]
        processed = runner.logits_processing.apply(logits, [reqs[i].request_id for i in row_req], params, preceding)
        if self.grammar is not None:  # one mask row per verified position of a structured request
            processed = self.grammar.apply(processed, reqs, runner._settle_placeholders, drafts)
        meta = SamplingMetadata.build(params, ntok, runner.vocab_size, runner.device, validated=True)
        x, top = runner.sampler.truncated(processed, meta)  # [rows, vocab], [rows]
        nxt = [drafts[i][j] if j < ks[i] else -1 for i, j in zip(row_req, row_j)]  # [rows] draft to check
        draft = host_to_device(nxt, torch.int64, runner.device)  # [rows]
        accept, candidate = self._accept(runner, x, top, draft, meta, params, ntok)
        n = len(reqs)
        starts = np.cumsum([0] + [k + 1 for k in ks])[:-1]  # [n] first row of each request
        col = np.arange(kmax + 1)[None, :]  # [1, kmax + 1]
        idx_host = starts[:, None] + np.minimum(col, np.array(ks)[:, None])  # [n, kmax + 1]
        idx = host_to_device(torch.from_numpy(idx_host), torch.int64, runner.device)
        valid = torch.arange(kmax, device=runner.device)[None, :] < host_to_device(ks, torch.int64, runner.device)[:, None]
        accepted = accept[idx[:, :kmax]] & valid  # [n, kmax]
        num_acc = accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [n] leading accepts
        last = candidate[idx.gather(1, num_acc[:, None]).squeeze(1)]  # [n]
        run = torch.where(torch.arange(kmax + 1, device=runner.device)[None, :] < num_acc[:, None],
                          draft[idx], torch.full_like(idx, -1))  # [n, kmax + 1]
        run.scatter_(1, num_acc[:, None], last[:, None])
        num_out = num_acc + 1  # [n]
        if step_lp is not None:  # the token each row emits: run[i, j], -1 past the run
            flat = [i * (kmax + 1) + j for i, j in zip(row_req, row_j)]  # [rows]
            step_lp.emitted(run.view(-1).index_select(0, host_to_device(flat, torch.int64, runner.device)),
                            reqs, row_req)
        runner.logits_processing.record_runs([r.request_id for r in reqs], run, num_out)
        packed = torch.cat([num_out[:, None], run], dim=1)  # [n, kmax + 2]
        allowed = [r.request_id in self.batch.drafts for r in reqs]
        return last, SpecOutputs(packed, ks, allowed) if n else SpecOutputs(packed, [], [])

    @staticmethod
    def _accept(runner, x: torch.Tensor, top: torch.Tensor, draft: torch.Tensor, meta: SamplingMetadata,
                params, ntok) -> tuple[torch.Tensor, torch.Tensor]:
        """(accept [rows] bool: the row's draft is accepted; candidate [rows]: the token the row
        emits when it is the first rejection or the bonus)."""
        has = draft >= 0  # [rows]
        safe = draft.clamp(min=0)  # [rows]
        if meta.all_greedy:
            return has & (top == draft), top
        p_draft = x.softmax(dim=-1).gather(1, safe[:, None]).squeeze(1)  # [rows] target probability of the draft
        u_acc = _acceptance_uniforms(runner, params, ntok)  # [rows] float64 in (0, 1]
        accept = has & (u_acc <= p_draft.double())
        masked = x.clone()
        rows = has.nonzero().squeeze(1)  # [m]
        masked[rows, safe[rows]] = _NEG_INF  # the residual: the target without the rejected draft
        candidate = inverse_cdf_sample(masked, runner.sampler.uniforms(meta), top)  # [rows]
        if meta.greedy is not None:
            accept = torch.where(meta.greedy, has & (top == draft), accept)
            candidate = torch.where(meta.greedy, top, candidate)
        return accept, candidate


def _acceptance_uniforms(runner, params, ntok) -> torch.Tensor:
    """[rows] float64 in (0, 1]: seeded rows hash (seed ^ ACCEPT_SALT, tokens held); the rest
    come from the sampler's generator."""
    u = 1.0 - torch.rand(len(params), generator=runner.sampler.generator, dtype=torch.float64, device=runner.device)
    seeded = [i for i, p in enumerate(params) if p.seed is not None]
    if seeded:
        values = seeded_uniforms([params[i].seed ^ ACCEPT_SALT for i in seeded], [ntok[i] for i in seeded])
        u[host_to_device(seeded, torch.int64, runner.device)] = host_to_device(torch.from_numpy(values),
                                                                               torch.float64, runner.device)
    return u
