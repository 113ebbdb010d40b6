"""Hugging Face greedy generation as the oracle, with the tie rule of the design.

Greedy tokens must equal HF's; a divergence is accepted only after a step where HF's
top-2 logit gap was below 1e-4 (argmax ambiguous), and `assert_matches_hf` checks that.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

TIE_GAP = 1e-4


class HFGreedy:
    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None  # like ignore_eos: EOS is a token like any other

    @torch.inference_mode()
    def generate(self, prompt: Sequence[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
        """(tokens, top-2 logit gap at each step), ignoring EOS."""
        ids = torch.tensor([list(prompt)])
        out = self.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
            do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
        )
        tokens = out.sequences[0, ids.shape[1]:].tolist()
        gaps = []
        for step_logits in out.logits:
            top2 = torch.topk(step_logits[0].float(), 2).values
            gaps.append(float(top2[0] - top2[1]))
        return tokens, gaps


def assert_matches_hf(got: Sequence[int], want: Sequence[int], gaps: Sequence[float], label: str = "") -> None:
    """got must equal want up to its length; a divergence only after a near-tie step."""
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            assert min(gaps[: i + 1]) < TIE_GAP, (
                f"{label}: token {i} is {g}, HF says {w}; no near-tie before it (min gap {min(gaps[: i + 1]):.2e})"
            )
            return
    assert len(got) <= len(want), f"{label}: {len(got)} tokens, HF made {len(want)}"
