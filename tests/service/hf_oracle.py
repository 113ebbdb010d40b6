"""Hugging Face greedy generation of a built-in checkpoint, as the service tests' oracle.

Comparison uses the model tests' `assert_matches_hf` (divergence only at a step whose HF
top-2 logit gap is below 1e-4).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch


class HFGreedy:
    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None  # like ignore_eos: EOS is a token like any other

    @torch.inference_mode()
    def generate(self, prompt: Sequence[int], max_new_tokens: int, **processors) -> tuple[list[int], list[float]]:
        """(tokens, top-2 logit gap at each step), ignoring EOS. `processors`: HF generate
        kwargs such as repetition_penalty / sequence_bias; gaps are then over the processed
        scores."""
        ids = torch.tensor([list(prompt)])
        out = self.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
            do_sample=False, output_logits=True, output_scores=True, return_dict_in_generate=True, pad_token_id=0,
            **processors,
        )
        tokens = out.sequences[0, ids.shape[1]:].tolist()
        gaps = []
        for step_logits in (out.scores if processors else out.logits):
            top2 = torch.topk(step_logits[0].float(), 2).values
            gaps.append(float(top2[0] - top2[1]))
        return tokens, gaps
