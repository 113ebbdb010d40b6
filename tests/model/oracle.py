"""Hugging Face oracles: batched greedy `generate` and tie-aware comparison of token streams."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from testing.checkpoints import VARIANTS, VOCAB, build_checkpoint

TIE_GAP = 1e-4
MAX_NEW = 48


@dataclass
class HFGreedy:
    tokens: list[list[int]]  # per prompt: the new tokens
    gaps: list[list[float]]  # per prompt, per new token: top-2 logit gap at that step


def hf_greedy(model, prompts: list[list[int]], max_new: int) -> HFGreedy:
    """One left-padded batched `generate` over all prompts (float32, greedy, no EOS stop)."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                             do_sample=False, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
    logits = torch.stack(out.logits, dim=1).float()  # [batch, max_new, vocab]
    top2 = logits.topk(2, dim=-1).values
    gaps = (top2[..., 0] - top2[..., 1]).tolist()
    return HFGreedy(out.sequences[:, width:].tolist(), gaps)


def assert_matches_hf(ours: list[int], expected: list[int], gaps: list[float], what: str) -> bool:
    """Tokens must equal HF's until a step whose top-2 gap is below TIE_GAP; returns True if
    the whole stream matched (False: diverged, legitimately, after a near-tie)."""
    assert len(ours) == len(expected), f"{what}: {len(ours)} tokens, HF produced {len(expected)}"
    for k, (a, b) in enumerate(zip(ours, expected)):
        if a != b:
            assert gaps[k] < TIE_GAP, (
                f"{what}: token {k} is {a}, HF says {b}, and HF's top-2 gap there is {gaps[k]:.3g} "
                f"(not a tie)\nours {ours}\nhf   {expected}"
            )
            return False
    return True


def random_prompts(seed: int, lens: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lens]


def oracle_case(path, variant: str, *, seed: int, prompt_seed: int, lens: list[int], max_new: int = MAX_NEW):
    """A test checkpoint of `VARIANTS[variant]` built into `path` (weights from `seed`), random prompts of
    `lens` (from `prompt_seed`) and HF's greedy continuations of them: (hf model, prompts, HFGreedy)."""
    model_type, overrides = VARIANTS[variant]
    hf = build_checkpoint(path, model_type, seed=seed, **overrides)
    prompts = random_prompts(prompt_seed, lens)
    return hf, prompts, hf_greedy(hf, prompts, max_new)


def check_against_hf(sched, prompts: list[list[int]], expected: HFGreedy) -> int:
    """Every finished request of a ToyScheduler run against HF; returns how many fully matched."""
    outputs = {r.request_id: r.output for r in sched.finished}
    assert len(outputs) == len(prompts)
    full = 0
    for i in range(len(prompts)):
        full += assert_matches_hf(outputs[f"r{i}"], expected.tokens[i], expected.gaps[i], f"r{i}")
    return full
