"""The device sampler against independent float64 NumPy references and chi-square tests.

The reference (`allowed_probs`) re-derives top-k → top-p (renormalised) → min-p from the
definitions, in float64, without touching the sampler's code.
"""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chi2_contingency, chisquare

from stepahead.plan import SamplingParams
from worker_service import sampler as sampler_module
from worker_service.sampler import Sampler, SamplingMetadata

CPU = torch.device("cpu")
P_VALUE_FLOOR = 1e-3  # the sampler is seeded, so each test is a fixed draw, not a flaky one
# the batch-invariance property runs several samplings per example: a fifth of the profile
FEWER_EXAMPLES = settings(max_examples=max(20, settings.default.max_examples // 5))
HALF_EXAMPLES = settings(max_examples=max(50, settings.default.max_examples // 2))


# ----------------------------------------------------------------------------- references


def allowed_probs(logits: np.ndarray, p: SamplingParams, tol: float = 0.0) -> np.ndarray:
    """[vocab] float64: the renormalised distribution `p` samples from (0 = not allowed).

    `tol` > 0 loosens the top-p and min-p cut-offs, giving a superset for float32 slack.
    """
    x = logits.astype(np.float64) / p.temperature
    vocab = x.shape[0]
    order = np.argsort(-x, kind="stable")
    k = p.top_k if 0 < p.top_k < vocab else vocab
    top = order[:k]
    probs = np.exp(x[top] - x[top].max())
    probs /= probs.sum()
    mass_before = np.cumsum(probs) - probs
    kept = top[mass_before < p.top_p + tol] if p.top_p < 1.0 else top
    if p.min_p > 0.0:
        kept = kept[x[kept] - x.max() >= np.log(p.min_p) - tol]
    out = np.zeros(vocab)
    out[kept] = np.exp(x[kept] - x[kept].max())
    return out / out.sum()


def boundary_margin(logits: np.ndarray, p: SamplingParams) -> float:
    """Distance of the closest top-p / min-p decision to its cut-off (for test set-up)."""
    if p.greedy:
        return np.inf
    x = logits.astype(np.float64) / p.temperature
    vocab = x.shape[0]
    k = p.top_k if 0 < p.top_k < vocab else vocab
    top = np.sort(x)[::-1][:k]
    margins = [np.inf]
    if p.top_p < 1.0:
        probs = np.exp(top - top.max())
        probs /= probs.sum()
        margins.append(np.abs(np.cumsum(probs) - probs - p.top_p).min())
    if p.min_p > 0.0:
        margins.append(np.abs(x - x.max() - np.log(p.min_p)).min())
    return float(min(margins))


def assert_follows(tokens: np.ndarray, probs: np.ndarray) -> None:
    """Every token allowed, and frequencies pass a chi-square test against `probs`."""
    outside = set(np.unique(tokens)) - set(np.flatnonzero(probs > 0))
    assert not outside, f"sampled tokens outside the allowed set: {sorted(outside)}"
    counts = np.bincount(tokens, minlength=probs.shape[0]).astype(np.float64)
    expected = probs * tokens.shape[0]
    support = np.flatnonzero(probs > 0)
    if support.size == 1:
        return
    big = support[expected[support] >= 5]  # merge small-expectation bins into one
    small = np.setdiff1d(support, big)
    obs = np.append(counts[big], counts[small].sum())
    exp = np.append(expected[big], expected[small].sum())
    if small.size == 0:
        obs, exp = obs[:-1], exp[:-1]
    result = chisquare(obs, exp)
    assert result.pvalue > P_VALUE_FLOOR, f"chi-square p={result.pvalue:.2e}: {obs} vs {exp.round(1)}"


def sample(rows_logits: np.ndarray, params: list[SamplingParams], num_tokens: list[int],
           sampler: Sampler | None = None, device: torch.device = CPU) -> np.ndarray:
    logits = torch.as_tensor(rows_logits, dtype=torch.float32, device=device)
    meta = SamplingMetadata.build(params, num_tokens, logits.shape[1], device)
    out = (sampler or Sampler(device, seed=1234))(logits, meta)
    assert out.dtype == torch.int64 and out.shape == (len(params),) and out.device == logits.device
    return out.cpu().numpy()


def random_logits(rng: np.random.Generator, vocab: int, scale: float = 2.0) -> np.ndarray:
    return (rng.standard_normal(vocab) * scale).astype(np.float32)


# ------------------------------------------------------------------------ greedy & basics


def test_temperature_zero_is_argmax_in_all_greedy_and_mixed_batches() -> None:
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((64, 1000)).astype(np.float32)
    greedy = SamplingParams(temperature=0.0)
    expected = logits.argmax(axis=1)
    np.testing.assert_array_equal(sample(logits, [greedy] * 64, [3] * 64), expected)
    mixed = [greedy if i % 2 else SamplingParams(top_p=0.9, seed=i) for i in range(64)]
    np.testing.assert_array_equal(sample(logits, mixed, [3] * 64)[1::2], expected[1::2])
    assert SamplingMetadata.build([greedy] * 3, [1] * 3, 10, CPU).all_greedy
    assert not SamplingMetadata.build([greedy, SamplingParams()], [1, 1], 10, CPU).all_greedy


def test_top_k_one_is_argmax_and_disabled_values_truncate_nothing() -> None:
    rng = np.random.default_rng(1)
    logits = np.tile(random_logits(rng, 8, scale=0.3), (6000, 1))
    assert (sample(logits[:500], [SamplingParams(top_k=1)] * 500, [0] * 500) == logits[0].argmax()).all()
    full = allowed_probs(logits[0], SamplingParams())
    for disabled in (SamplingParams(top_k=0), SamplingParams(top_k=-1), SamplingParams(top_k=8),
                     SamplingParams(top_k=100), SamplingParams(top_p=1.0, min_p=0.0)):
        assert_follows(sample(logits, [disabled] * 6000, [0] * 6000), full)


def test_unseeded_rows_follow_the_sampler_generator() -> None:
    rng = np.random.default_rng(2)
    logits = np.tile(random_logits(rng, 50, scale=0.5), (200, 1))
    params, counts = [SamplingParams()] * 200, [7] * 200
    first = sample(logits, params, counts, Sampler(CPU, seed=5))
    np.testing.assert_array_equal(first, sample(logits, params, counts, Sampler(CPU, seed=5)))
    assert (first != sample(logits, params, counts, Sampler(CPU, seed=6))).any()
    sampler = Sampler(CPU, seed=5)
    assert (sample(logits, params, counts, sampler) != sample(logits, params, counts, sampler)).any()


# ------------------------------------------------------------------- distributions & sets

N_DRAWS = 20_000
CONFIGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=1.7),
    SamplingParams(top_k=5),
    SamplingParams(top_p=0.8),
    SamplingParams(min_p=0.1),
    SamplingParams(temperature=0.8, top_k=10, top_p=0.7),
    SamplingParams(temperature=1.3, top_k=12, top_p=0.9, min_p=0.05),
]


def config_logits(p: SamplingParams, vocab: int = 24) -> np.ndarray:
    """Logits whose top-p / min-p decisions sit at least 1e-3 from their cut-offs."""
    rng = np.random.default_rng(zlib.crc32(repr(p).encode()))
    for _ in range(100):
        logits = random_logits(rng, vocab, scale=1.5)
        if boundary_margin(logits, p) > 1e-3:
            return logits
    raise AssertionError(f"no logits with a safe margin for {p}")


@pytest.mark.parametrize("params", CONFIGS, ids=repr)
def test_single_config_batch_matches_its_distribution(params: SamplingParams) -> None:
    logits = config_logits(params)
    tokens = sample(np.tile(logits, (N_DRAWS, 1)), [params] * N_DRAWS, [0] * N_DRAWS)
    assert_follows(tokens, allowed_probs(logits, params))


def test_seeded_draws_over_seeds_and_num_tokens_match_the_distribution() -> None:
    params = SamplingParams(temperature=0.9, top_k=15, top_p=0.95)
    logits = config_logits(params)
    rows = np.tile(logits, (N_DRAWS, 1))
    by_seed = [dataclasses.replace(params, seed=s) for s in range(N_DRAWS)]
    assert_follows(sample(rows, by_seed, [17] * N_DRAWS), allowed_probs(logits, params))
    fixed_seed = [dataclasses.replace(params, seed=42)] * N_DRAWS
    assert_follows(sample(rows, fixed_seed, list(range(N_DRAWS))), allowed_probs(logits, params))


def assert_mixed_batch_follows(configs: list[SamplingParams], repeats: int = 4000) -> None:
    """Rows of all `configs`, shuffled into one batch, each follow their own distribution."""
    logits = np.stack([config_logits(p) for p in configs])  # [configs, vocab]
    order = np.random.default_rng(3).permutation(len(configs) * repeats) % len(configs)
    params = [dataclasses.replace(configs[i], seed=None if configs[i].seed is None else int(r))
              for r, i in enumerate(order)]
    tokens = sample(logits[order], params, [11] * len(order))
    for i, p in enumerate(configs):
        if p.greedy:
            assert (tokens[order == i] == logits[i].argmax()).all()
        else:
            assert_follows(tokens[order == i], allowed_probs(logits[i], p))


def test_mixed_batch_rows_each_honour_their_own_params() -> None:
    assert_mixed_batch_follows(CONFIGS + [SamplingParams(temperature=0.0), SamplingParams(top_k=3, seed=9)])


def test_per_row_top_k_and_min_p_without_top_p_rows() -> None:
    """No row uses top-p, so top-k takes the partial `topk` path with a different k per row."""
    configs = [SamplingParams(top_k=k) for k in (1, 2, 3, 5, 8)]
    configs += [SamplingParams(min_p=0.05), SamplingParams(temperature=0.7, min_p=0.3),
                SamplingParams(top_k=4, min_p=0.2, seed=1), SamplingParams(temperature=0.0)]
    assert_mixed_batch_follows(configs)


@pytest.mark.parametrize("width", [4, 8, 16])
def test_cpu_candidate_top_p_keeps_the_same_tokens_as_a_full_sort(
    monkeypatch: pytest.MonkeyPatch, width: int
) -> None:
    """The CPU shortcut (cut-off among the top `width` logits, else sort) against the sort."""
    monkeypatch.setattr(sampler_module, "CPU_TOP_P_CANDIDATES", width)
    rng = np.random.default_rng(width)
    vocab, rows = 40, []
    for scale in (0.05, 1.0, 4.0):  # flat (cut-off beyond the candidates) to peaked
        for top_k in (vocab, 3, width, width + 5):
            for top_p in (0.3, 0.9, 0.99, float("inf")):
                rows.append((random_logits(rng, vocab, scale), top_k, top_p))
    x = torch.as_tensor(np.stack([r[0] for r in rows]))  # [rows, vocab]
    k = torch.tensor([r[1] for r in rows])
    top_p = torch.tensor([r[2] for r in rows], dtype=torch.float32)
    shortcut = sampler_module._threshold_from_candidates(x, x.amax(dim=-1), k, top_p)  # [rows]
    full = sampler_module._threshold_from_sort(x, k, top_p)  # [rows]
    torch.testing.assert_close(x >= shortcut[:, None], x >= full[:, None], rtol=0, atol=0)


def test_mixed_batch_through_the_cpu_candidate_top_p(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sampler_module, "CPU_TOP_P_CANDIDATES", 6)
    extra = [SamplingParams(top_p=0.95, seed=3), SamplingParams(top_k=4, top_p=0.6)]
    assert_mixed_batch_follows(CONFIGS + extra, repeats=2500)


params_strategy = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.3, 1.0, 2.0]),
    top_k=st.sampled_from([-1, 0, 1, 2, 5, 40, 64, 100]),
    top_p=st.sampled_from([1.0, 0.99, 0.9, 0.5, 0.1, 1e-6]),
    min_p=st.sampled_from([0.0, 0.01, 0.2, 0.9, 1.0]),
    seed=st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),  # the API's int64 range
)


@HALF_EXAMPLES
@given(configs=st.lists(params_strategy, min_size=1, max_size=4), logits_seed=st.integers(0, 2**32 - 1))
def test_never_samples_outside_the_allowed_set(configs: list[SamplingParams], logits_seed: int) -> None:
    """Rows cycle through up to four configs, so per-row top-k values differ in one batch."""
    rng = np.random.default_rng(logits_seed)
    vocab = 64 if logits_seed % 2 else 600  # 600: CPU top-p through the candidate shortcut
    logits = np.stack([random_logits(rng, vocab, scale=3.0) for _ in configs])  # [configs, vocab]
    which = np.arange(128) % len(configs)
    tokens = sample(logits[which], [configs[i] for i in which], list(range(128)))
    for i, p in enumerate(configs):
        if p.greedy:
            assert (tokens[which == i] == logits[i].argmax()).all()
            continue
        allowed = np.flatnonzero(allowed_probs(logits[i], p, tol=1e-4) > 0)
        bad = set(tokens[which == i]) - set(allowed)
        assert not bad, f"{p}: sampled {sorted(bad)} outside {allowed}"


# ---------------------------------------------------------------------- seeded invariance


def assert_batch_invariant(data: st.DataObject, device: torch.device) -> None:
    """Seeded rows give the same token alone and among random neighbours at any position."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="rng"))
    vocab = data.draw(st.sampled_from([16, 64, 1000]), label="vocab")
    seeded_params = [dataclasses.replace(p, seed=s) for p, s in data.draw(
        st.lists(st.tuples(params_strategy.filter(lambda p: not p.greedy), st.integers(-(2**63), 2**63 - 1)),
                 min_size=1, max_size=4), label="seeded")]
    targets = [(p, int(rng.integers(0, 4096)), random_logits(rng, vocab)) for p in seeded_params]
    alone = [sample(lg[None], [p], [t], Sampler(device, seed=0), device)[0] for p, t, lg in targets]
    for trial in range(3):
        neighbours = data.draw(st.lists(params_strategy, max_size=12), label=f"neighbours{trial}")
        rows = [(p, int(rng.integers(0, 4096)), random_logits(rng, vocab)) for p in neighbours]
        slots = rng.permutation(len(rows) + len(targets))[: len(targets)]
        for slot, target in sorted(zip(slots, targets), key=lambda pair: pair[0]):
            rows.insert(int(slot), target)
        batch = sample(np.stack([r[2] for r in rows]), [r[0] for r in rows], [r[1] for r in rows],
                       Sampler(device, seed=trial + 1), device)
        got = [batch[next(i for i, r in enumerate(rows) if r is target)] for target in targets]
        assert got == alone, f"trial {trial}: {got} in a batch of {len(rows)} vs {alone} alone"


@FEWER_EXAMPLES
@given(data=st.data())
def test_seeded_draw_is_invariant_to_batch_composition(data: st.DataObject) -> None:
    assert_batch_invariant(data, CPU)


@pytest.mark.gpu
@FEWER_EXAMPLES
@given(data=st.data())
def test_seeded_cuda_draw_is_invariant_to_batch_composition(data: st.DataObject) -> None:
    assert_batch_invariant(data, torch.device("cuda"))


@pytest.mark.gpu
def test_seeded_draws_agree_between_cpu_and_cuda() -> None:
    """Both devices use the same hashed uniform; only float rounding at a CDF or cut-off
    boundary may tell them apart, so nearly every row must agree."""
    rng = np.random.default_rng(7)
    configs = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
               for t in (0.5, 1.0) for k in (-1, 20) for p in (1.0, 0.9) for m in (0.0, 0.05)]
    params = [dataclasses.replace(configs[i % len(configs)], seed=i) for i in range(2000)]
    logits = (rng.standard_normal((2000, 1000)) * 3).astype(np.float32)
    counts = list(range(2000))
    on_cpu = sample(logits, params, counts, Sampler(CPU), CPU)
    on_cuda = sample(logits, params, counts, Sampler(torch.device("cuda")), torch.device("cuda"))
    assert (on_cpu == on_cuda).mean() > 0.99


def test_different_num_tokens_give_independent_draws() -> None:
    """Draws at num_tokens t and t + 1 of one seed: contingency table shows no dependence."""
    logits = np.zeros((1, 4), dtype=np.float32)  # uniform over 4 tokens
    num_seeds = 8000
    params = [SamplingParams(seed=s) for s in range(num_seeds)]
    rows = np.repeat(logits, num_seeds, axis=0)
    now = sample(rows, params, [100] * num_seeds)
    later = sample(rows, params, [101] * num_seeds)
    table = np.zeros((4, 4))
    np.add.at(table, (now, later), 1)
    assert chi2_contingency(table).pvalue > P_VALUE_FLOOR, table
    again = sample(rows, params, [100] * num_seeds, Sampler(CPU, seed=999))
    np.testing.assert_array_equal(now, again)  # the sampler's own seed plays no part


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (SamplingParams(temperature=-0.1), "temperature"),
        (SamplingParams(temperature=float("nan")), "temperature"),
        (SamplingParams(top_k=-2), "top_k"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(top_p=1.5), "top_p"),
        (SamplingParams(min_p=-0.5), "min_p"),
        (SamplingParams(min_p=2.0), "min_p"),
    ],
)
def test_build_rejects_invalid_params(params: SamplingParams, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingMetadata.build([SamplingParams(), params], [1, 1], 10, CPU)


def test_mismatched_inputs_are_rejected() -> None:
    with pytest.raises(ValueError, match="num_tokens"):
        SamplingMetadata.build([SamplingParams()], [1, 2], 10, CPU)
    with pytest.raises(ValueError, match="num_tokens"):
        SamplingMetadata.build([SamplingParams()], [-1], 10, CPU)
    meta = SamplingMetadata.build([SamplingParams()] * 2, [1, 1], 10, CPU)
    with pytest.raises(ValueError, match="shape"):
        Sampler(CPU)(torch.zeros(2, 11), meta)
    with pytest.raises(ValueError, match="floating point"):
        Sampler(CPU)(torch.zeros(2, 10, dtype=torch.int64), meta)
    elsewhere = SamplingMetadata.build([SamplingParams()] * 2, [1, 1], 10, torch.device("meta"))
    with pytest.raises(ValueError, match="metadata on meta"):
        Sampler(CPU)(torch.zeros(2, 10), elsewhere)
