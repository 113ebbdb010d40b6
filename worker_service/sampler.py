"""Device-side token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Every row of a batch carries its own `SamplingParams`; all of them are applied in one pass
of vectorised tensor ops (no per-row Python loop in `Sampler.__call__`).

Truncation (the order Hugging Face's warpers use): logits are divided by the temperature,
then top-k keeps the k largest, top-p keeps the smallest prefix (by descending
probability) of the *renormalised* top-k distribution whose mass reaches p, and min-p keeps
tokens whose probability is at least `min_p` times the largest one. Each rule is a per-row
logit threshold, so the three combine into one `max` and one masking pass. Tokens tied
with the threshold value are kept (top-k may then keep more than k tokens, as in vLLM).

The draw is inverse-CDF sampling with ONE uniform number per row:
`token = first i with cdf[i] >= u * cdf[-1]`, u in (0, 1]. For a seeded request, u is a
53-bit hash of (seed, num_tokens) computed on the host while the metadata is built, so
its draw depends only on those two numbers and its own logits: never on batch
composition, row order, preemption or timing (and it is the same u on CPU and CUDA).
Unseeded rows take u from the sampler's device generator. The exponential race
(`argmax(probs / q)`) would need one random number per vocabulary entry (batch x vocab
draws per step, costly on CPU) and a per-row generator loop for seeded rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from stepahead import limits
from stepahead.plan import SamplingParams

_MASK64 = (1 << 64) - 1
_NEG_INF = float("-inf")

# Rows of the packed per-step host tensor (float64 holds every field exactly).
_TEMPERATURE, _TOP_K, _TOP_P, _LOG_MIN_P, _SEEDED_U, _SEEDED, _GREEDY = range(7)
_NUM_FIELDS = 7

# CPU top-p looks for its cut-off among this many largest logits before sorting a row.
CPU_TOP_P_CANDIDATES = 256


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """One SplitMix64 step on uint64 arrays (wrapping arithmetic): a bijective 64-bit mixer
    with full avalanche."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def seeded_uniforms(seeds: Sequence[int], num_tokens: Sequence[int]) -> np.ndarray:
    """[n] float64: the uniform in (0, 1] each seeded row draws when its request holds
    `num_tokens` tokens (one vectorised pass; the host packs these every step)."""
    s = np.array([x & _MASK64 for x in seeds], dtype=np.uint64)
    t = np.array([x & _MASK64 for x in num_tokens], dtype=np.uint64)
    mixed = _splitmix64(_splitmix64(s) ^ t)
    return ((mixed >> np.uint64(11)) + np.uint64(1)).astype(np.float64) * 2.0**-53  # exact: < 2^53 + 1


def seeded_uniform(seed: int, num_tokens: int) -> float:
    """The uniform in (0, 1] a seeded request draws when it holds `num_tokens` tokens."""
    return float(seeded_uniforms([seed], [num_tokens])[0])


def canonical_device(device: torch.device | str) -> torch.device:
    """`device` with its index filled in ("cuda" -> "cuda:0"), as tensors report it."""
    return torch.empty(0, device=device).device


def _validate(params: SamplingParams, num_tokens: int, row: int, vocab_size: int) -> None:
    """The shared request limits (`stepahead.limits`), plus what only the sampler knows."""
    try:
        checked = limits.check_sampling(params, vocab_size=vocab_size)
    except limits.LimitError as exc:
        raise ValueError(f"row {row}: {exc}") from None
    if checked != params:
        raise ValueError(f"row {row}: sampling params are not normalised by stepahead.limits: {params}")
    if num_tokens < 0:
        raise ValueError(f"row {row}: num_tokens must be >= 0, got {num_tokens}")


def _columns(params: Sequence[SamplingParams], num_tokens: Sequence[int], vocab_size: int) -> np.ndarray:
    """The packed float64 fields `[fields, n]` (see the `_TEMPERATURE`... indices), column by column.

    Greedy rows get temperature 1 and no truncation: their answer is the argmax of x.
    Disabled stages: top_k = vocab, top_p = +inf (not 1: rounding in a cumulative sum
    cannot reach it), log_min_p = -inf.
    """
    n = len(params)
    out = np.zeros((_NUM_FIELDS, n), dtype=np.float64)
    greedy = np.fromiter([p.greedy for p in params], np.bool_, n)
    sampled = ~greedy
    temperature = np.fromiter([p.temperature for p in params], np.float64, n)
    top_k = np.fromiter([p.top_k for p in params], np.float64, n)
    top_p = np.fromiter([p.top_p for p in params], np.float64, n)
    out[_TEMPERATURE] = np.where(greedy, 1.0, temperature)
    out[_TOP_K] = np.where(sampled & (top_k > 0) & (top_k < vocab_size), top_k, float(vocab_size))
    out[_TOP_P] = np.where(sampled & (top_p < 1.0), top_p, math.inf)
    out[_LOG_MIN_P] = [math.log(p.min_p) if p.min_p > 0.0 and not p.greedy else -math.inf for p in params]
    seeded_rows = [i for i, p in enumerate(params) if p.seed is not None and not p.greedy]
    if seeded_rows:
        out[_SEEDED_U, seeded_rows] = seeded_uniforms([params[i].seed for i in seeded_rows],
                                                      [num_tokens[i] for i in seeded_rows])
        out[_SEEDED, seeded_rows] = 1.0
    out[_GREEDY] = greedy
    return out


@dataclass(frozen=True)
class SamplingMetadata:
    """Per-row sampling tensors for one step, on the device, plus host-side flags.

    The flags let `Sampler` skip whole stages (e.g. the sort) without reading the device.
    Tensors are `None` when no row of the batch uses that stage.
    """

    num_rows: int
    vocab_size: int
    device: torch.device
    all_greedy: bool
    temperature: torch.Tensor | None  # [n] float32, 1.0 on greedy rows
    greedy: torch.Tensor | None  # [n] bool, None when no row is greedy
    top_k: torch.Tensor | None  # [n] int64 in [1, vocab]; vocab = disabled
    top_k_max: int  # largest enabled top_k (0 when none)
    top_p: torch.Tensor | None  # [n] float32; +inf = disabled
    log_min_p: torch.Tensor | None  # [n] float32; -inf = disabled
    seeded_u: torch.Tensor | None  # [n] float64 uniforms of seeded rows
    seeded: torch.Tensor | None  # [n] bool, None when no row is seeded
    needs_generator: bool  # some sampled row takes its uniform from the shared generator

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        num_tokens: Sequence[int],
        vocab_size: int,
        device: torch.device,
        validated: bool = False,
    ) -> SamplingMetadata:
        """Pack every row's params into one host tensor and copy it to `device` once.

        `validated=True`: every row already passed `stepahead.limits` (the runner checks each
        request's row once, when it is admitted) and the per-row check is skipped: at 256
        rows it would cost milliseconds of host time per step.
        """
        if len(params) != len(num_tokens):
            raise ValueError(f"{len(params)} sampling params but {len(num_tokens)} num_tokens")
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        device = canonical_device(device)
        if not validated:
            for row, (p, n) in enumerate(zip(params, num_tokens)):
                _validate(p, n, row, vocab_size)
        all_greedy = all(p.greedy for p in params)
        if all_greedy:
            return cls._greedy_only(len(params), vocab_size, device)
        cols = _columns(params, num_tokens, vocab_size)  # [fields, n] float64, host
        sampled = cols[_GREEDY] == 0.0  # [n]
        top_k_on = sampled & (cols[_TOP_K] < vocab_size)
        any_seeded = bool(cols[_SEEDED].any())
        packed = cls._pack(cols, device)  # [fields, n] float64 on the device
        return cls(
            num_rows=len(params),
            vocab_size=vocab_size,
            device=device,
            all_greedy=False,
            temperature=packed[_TEMPERATURE].float(),
            greedy=packed[_GREEDY].bool() if not sampled.all() else None,
            top_k=packed[_TOP_K].long() if top_k_on.any() else None,
            top_k_max=int(cols[_TOP_K][top_k_on].max()) if top_k_on.any() else 0,
            top_p=packed[_TOP_P].float() if (sampled & (cols[_TOP_P] < math.inf)).any() else None,
            log_min_p=packed[_LOG_MIN_P].float() if (sampled & (cols[_LOG_MIN_P] > -math.inf)).any() else None,
            seeded_u=packed[_SEEDED_U] if any_seeded else None,
            seeded=packed[_SEEDED].bool() if any_seeded else None,
            needs_generator=bool((sampled & (cols[_SEEDED] == 0.0)).any()),
        )

    @classmethod
    def _greedy_only(cls, num_rows: int, vocab_size: int, device: torch.device) -> SamplingMetadata:
        return cls(
            num_rows=num_rows, vocab_size=vocab_size, device=device, all_greedy=True,
            temperature=None, greedy=None, top_k=None, top_k_max=0, top_p=None,
            log_min_p=None, seeded_u=None, seeded=None, needs_generator=False,
        )

    @staticmethod
    def _pack(cols: np.ndarray, device: torch.device) -> torch.Tensor:
        host = torch.from_numpy(cols)  # [fields, n] float64
        if device.type != "cuda":
            return host.to(device)
        # pinned + non_blocking: one asynchronous H2D copy, no wait on the in-flight step
        return host.pin_memory().to(device, non_blocking=True)


class Sampler:
    """Samples one token per row of `logits` according to a `SamplingMetadata`."""

    def __init__(self, device: torch.device, seed: int = 0):
        self.device = canonical_device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed & _MASK64)

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """logits: [n, vocab] → sampled token ids [n] int64 on logits.device."""
        self._check(logits, meta)
        if meta.all_greedy:
            return logits.float().argmax(dim=-1)
        x, top = self.truncated(logits, meta)
        sampled = inverse_cdf_sample(x, self._uniforms(meta), top)  # [n]
        if meta.greedy is None:
            return sampled
        return torch.where(meta.greedy, top, sampled)

    def truncated(self, logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(x [n, vocab]: the logits after temperature and truncation, -inf where dropped, whose
        softmax is the target distribution; top [n]: each row's argmax, the greedy answer)."""
        logits = logits.float()  # [n, vocab]
        if meta.all_greedy:
            return logits, logits.argmax(dim=-1)
        x = logits / meta.temperature[:, None]  # [n, vocab]; greedy rows: x == logits
        top = x.argmax(dim=-1)  # [n]: greedy answers, and the fallback of inverse_cdf_sample
        x_max = x.gather(-1, top[:, None]).squeeze(-1)  # [n]
        threshold = truncation_threshold(x, x_max, meta)  # [n] or None
        if threshold is not None:
            x = drop_below(x, threshold, x_max)
        return x, top

    def uniforms(self, meta: SamplingMetadata) -> torch.Tensor | None:
        """[n] float64 in (0, 1], the draw of each sampled row (None when every row is greedy)."""
        return None if meta.all_greedy else self._uniforms(meta)

    def _uniforms(self, meta: SamplingMetadata) -> torch.Tensor:
        """[n] float64 in (0, 1]: seeded rows' hashed uniforms, the rest from the generator."""
        if not meta.needs_generator:
            return meta.seeded_u
        u = torch.rand(meta.num_rows, generator=self.generator, dtype=torch.float64, device=self.device)
        u = 1.0 - u  # [0, 1) -> (0, 1]
        if meta.seeded is None:
            return u
        return torch.where(meta.seeded, meta.seeded_u, u)

    def _check(self, logits: torch.Tensor, meta: SamplingMetadata) -> None:
        if logits.dim() != 2 or logits.shape != (meta.num_rows, meta.vocab_size):
            raise ValueError(
                f"logits shape {tuple(logits.shape)} != "
                f"({meta.num_rows}, {meta.vocab_size}) from the metadata"
            )
        if not logits.is_floating_point():
            raise ValueError(f"logits must be floating point, got {logits.dtype}")
        if logits.device != meta.device or logits.device != self.device:
            raise ValueError(
                f"logits on {logits.device}, metadata on {meta.device}, sampler on {self.device}"
            )


def truncation_threshold(x: torch.Tensor, x_max: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor | None:
    """[n] float32: per-row logit below which top-k / top-p / min-p drop a token.

    x: [n, vocab] temperature-scaled logits; x_max: [n] their row maxima. -inf where a row
    truncates nothing; None when no row of the batch truncates.
    """
    threshold = None
    if meta.top_p is not None:
        threshold = _top_k_top_p_threshold(x, x_max, meta.top_k, meta.top_p)
    elif meta.top_k is not None:
        threshold = _top_k_threshold(x, meta.top_k, meta.top_k_max)
    if meta.log_min_p is not None:
        # p_i / p_max >= min_p  <=>  x_i >= x_max + log(min_p): no softmax needed
        min_p_threshold = x_max + meta.log_min_p  # [n]
        threshold = min_p_threshold if threshold is None else torch.maximum(threshold, min_p_threshold)
    return threshold


def drop_below(x: torch.Tensor, threshold: torch.Tensor, x_max: torch.Tensor) -> torch.Tensor:
    """[n, vocab]: x shifted by a per-row constant, -inf where x < threshold.

    softmax ignores a per-row shift, and `F.threshold` (one pass) is faster on CPU than
    a masked fill. With cut = nextafter(floor, -inf), `x - cut > 0` holds exactly when
    `x >= floor` (a float difference is never rounded to zero or across it).
    """
    # logits over 200 below the row maximum have probability < 1e-86, i.e. 0 in float32
    floor = torch.maximum(threshold, x_max - 200.0)[:, None]  # [n, 1], finite
    cut = torch.nextafter(floor, torch.full_like(floor, _NEG_INF))  # [n, 1]
    return torch.nn.functional.threshold(x - cut, 0.0, _NEG_INF)  # [n, vocab]


def _top_k_threshold(x: torch.Tensor, top_k: torch.Tensor, top_k_max: int) -> torch.Tensor:
    """[n]: the k-th largest logit per row (-inf where top-k is disabled, k == vocab)."""
    values = x.topk(top_k_max, dim=-1).values  # [n, k_max] descending
    kth = values.gather(-1, (top_k.clamp(max=top_k_max) - 1)[:, None]).squeeze(-1)  # [n]
    return kth.masked_fill(top_k >= x.shape[-1], _NEG_INF)


def _top_k_top_p_threshold(
    x: torch.Tensor, x_max: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor
) -> torch.Tensor:
    """[n]: smallest kept logit after top-k then top-p on the renormalised top-k mass."""
    vocab = x.shape[-1]
    k = top_k if top_k is not None else torch.full_like(top_p, vocab, dtype=torch.int64)  # [n]
    if x.device.type == "cpu" and vocab > CPU_TOP_P_CANDIDATES:
        return _threshold_from_candidates(x, x_max, k, top_p)
    return _threshold_from_sort(x, k, top_p)


def _threshold_from_sort(x: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[n]: the top-k / top-p cut-off from a full descending sort of each row."""
    sorted_x = x.sort(dim=-1, descending=True).values  # [n, vocab]
    return _prefix_cutoff(sorted_x, k, top_p, log_norm=None)[0]


def _threshold_from_candidates(
    x: torch.Tensor, x_max: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """[n]: the cut-off from each row's top `CPU_TOP_P_CANDIDATES` logits (CPU only).

    A full sort dominates CPU sampling time; the cut-off usually lies among the first few
    hundred tokens, and `topk` finds those much faster. Rows where it does not (flat
    distributions, or C < top_k < vocab) are sorted in full. Which way a row goes depends
    only on that row, so seeded draws stay batch-invariant. Reading `covered` back costs
    nothing on CPU, where no device runs ahead of the host.
    """
    vocab, width = x.shape[-1], CPU_TOP_P_CANDIDATES
    candidates = x.topk(width, dim=-1).values  # [n, C] descending
    within = k <= width  # [n]: the whole top-k set is among the candidates
    outside = torch.arange(width, device=x.device)[None, :] >= k[:, None]  # [n, C]
    top_k_norm = candidates.masked_fill(outside, _NEG_INF).logsumexp(dim=-1)  # [n]
    full_norm = x_max + (x - x_max[:, None]).exp().sum(dim=-1).log()  # [n] logsumexp of the row
    log_norm = torch.where(within, top_k_norm, full_norm)  # [n], exact where it is used
    threshold, mass = _prefix_cutoff(candidates, k, top_p, log_norm)
    untruncated = (k >= vocab) & top_p.isinf()  # [n]
    threshold = threshold.masked_fill(untruncated, _NEG_INF)
    covered = within | untruncated | ((k >= vocab) & (mass >= top_p))  # [n]
    if not bool(covered.all()):
        rows = (~covered).nonzero().squeeze(-1)  # [m]
        threshold[rows] = _threshold_from_sort(x[rows], k[rows], top_p[rows])
    return threshold


def _prefix_cutoff(
    desc: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor, log_norm: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut-off logit [n] of the kept prefix of `desc`, and the top-k mass `desc` holds [n].

    desc: [n, m] each row's m largest logits, descending. log_norm: [n] log of the top-k
    normaliser, or None when `desc` holds the whole row (it is then computed here).
    """
    keep = torch.arange(desc.shape[-1], device=desc.device)[None, :] < k[:, None]  # [n, m]
    masked = desc.masked_fill(~keep, _NEG_INF)  # [n, m]
    if log_norm is None:
        log_norm = masked.logsumexp(dim=-1)  # [n]
    probs = (masked - log_norm[:, None]).exp()  # [n, m] renormalised over the top-k set
    cumulative = probs.cumsum(dim=-1)  # [n, m]
    keep &= cumulative - probs < top_p[:, None]  # mass strictly above < p; position 0 always kept
    num_kept = keep.sum(dim=-1).clamp_(min=1)  # [n] >= 1 even if top_p were 0 in float32
    return desc.gather(-1, (num_kept - 1)[:, None]).squeeze(-1), cumulative[:, -1]


def inverse_cdf_sample(x: torch.Tensor, u: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """[n] int64: per row, the token where `u` falls in the CDF of softmax(x).

    x: [n, vocab] logits, -inf where masked; u: [n] float64 in (0, 1]; fallback: [n] an
    allowed token per row. With 0 < target <= total, the first i with cdf[i] >= target has
    cdf[i] > cdf[i - 1], i.e. a token of non-zero probability.
    """
    probs = x.softmax(dim=-1)  # [n, vocab]
    cdf = probs.cumsum(dim=-1)  # [n, vocab], non-decreasing
    target = (u.to(cdf.dtype) * cdf[:, -1])[:, None]  # [n, 1] in (0, total]
    token = torch.searchsorted(cdf, target).squeeze(-1)  # [n]: first cdf >= target
    token = token.clamp_(max=x.shape[-1] - 1)
    # A parallel scan (CUDA) is not exactly monotone; should that ever land on a masked
    # token, take the fallback (the row's argmax) instead.
    masked = x.gather(-1, token[:, None]).squeeze(-1) == _NEG_INF  # [n]
    return torch.where(masked, fallback, token)
