"""Random-init Hugging Face checkpoints built locally for the model tests."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 512

# name -> (model_type, config overrides). Covers tied/untied and GQA ratios 1 and 4.
VARIANTS: dict[str, tuple[str, dict]] = {
    "llama_tied_gqa4": ("llama", dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True,
                                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                                      rope_theta=5000.0)),
    # every layer windowed: prompts and generations run past the window
    "mistral_untied_gqa1": ("mistral", dict(num_attention_heads=4, num_key_value_heads=4,
                                            tie_word_embeddings=False, sliding_window=16)),
    "qwen2_untied_gqa4": ("qwen2", dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False,
                                        rope_theta=1_000_000.0)),
    "qwen3_tied_gqa1": ("qwen3", dict(num_attention_heads=4, num_key_value_heads=4, head_dim=24,
                                      tie_word_embeddings=True)),
    # fused qkv_proj / gate_up_proj in the checkpoint, split per part under TP
    "phi3_untied_gqa4": ("phi3", dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)),
    # post-norms, q/k norms over the whole width (all-reduced under TP)
    "olmo2_untied_gqa4": ("olmo2", dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False,
                                        rope_theta=500_000.0)),
    # Mixture of experts: 4 experts, top-2, per-expert checkpoint tensors stacked per layer;
    # Qwen3-MoE's layer 1 a dense MLP (mlp_only_layers)
    "qwen3_moe_untied_gqa2": ("qwen3_moe", dict(num_attention_heads=4, num_key_value_heads=2,
                                                tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
                                                moe_intermediate_size=32, norm_topk_prob=True,
                                                num_hidden_layers=3, mlp_only_layers=[1])),
    "mixtral_tied_gqa2": ("mixtral", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                          num_local_experts=4, num_experts_per_tok=2, intermediate_size=64)),
    # not Llama-shaped: LayerNorm, learned positions, gelu_new, Conv1D [in, out] weights, tied head
    "gpt2_tied": ("gpt2", dict(num_attention_heads=4, n_inner=128)),
    # (1 + w) norms before and after each sublayer, GeGLU, scaled embedding, query_pre_attn_scalar,
    # sliding (window 16) and global layers alternating; Gemma 2 soft-caps scores and logits
    "gemma2_tied_gqa2": ("gemma2", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        num_hidden_layers=4, sliding_window=16, query_pre_attn_scalar=24,
                                        attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    # Gemma 3: q/k norms, per-layer-type rope bases, every 2nd layer global here
    "gemma3_text_untied_gqa2": ("gemma3_text", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                    num_hidden_layers=4, sliding_window=12,
                                                    tie_word_embeddings=False, query_pre_attn_scalar=16,
                                                    layer_types=["sliding_attention", "full_attention"] * 2,
                                                    rope_parameters={
                                                        "sliding_attention": {"rope_type": "default",
                                                                              "rope_theta": 10_000.0},
                                                        "full_attention": {"rope_type": "default",
                                                                           "rope_theta": 1_000_000.0}},
                                                    final_logit_softcapping=4.0)),
}

# Rope types past default / llama3 and partial rotary (tests/model/test_rope_variants.py): the
# trained length 32, so prompts and generations cross it; 4 heads of 16 (8 frequencies).
_LONG = [1.0 + 0.5 * i for i in range(8)]  # longrope's divisors at and past the trained length
_SHORT = [1.0 + 0.05 * i for i in range(8)]
ROPE_VARIANTS: dict[str, tuple[str, dict]] = {
    "llama_linear": ("llama", dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   rope_scaling={"rope_type": "linear", "factor": 4.0})),
    # HF grows the base past max_position_embeddings (32); served to factor times it
    "llama_dynamic": ("llama", dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                    rope_scaling={"rope_type": "dynamic", "factor": 4.0})),
    "llama_yarn": ("llama", dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                 rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 16.0,
                                               "original_max_position_embeddings": 32})),
    "llama_longrope": ("llama", dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                     rope_scaling={"rope_type": "longrope", "short_factor": _SHORT,
                                                   "long_factor": _LONG, "original_max_position_embeddings": 32})),
    # Phi-3-128k's layout: the trained length at the top level, factor from the two lengths
    "phi3_longrope": ("phi3", dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   original_max_position_embeddings=32,
                                   rope_scaling={"type": "longrope", "short_factor": _SHORT, "long_factor": _LONG})),
    "phi3_partial": ("phi3", dict(num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=0.5)),
    # Gemma 3 4B+'s layout: the global layers' rope scaled linearly, the sliding ones' plain (window 12)
    "gemma3_linear": ("gemma3_text", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                          num_hidden_layers=4, sliding_window=12, query_pre_attn_scalar=16,
                                          max_position_embeddings=128,
                                          layer_types=["sliding_attention", "full_attention"] * 2,
                                          rope_parameters={
                                              "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                              "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                 "rope_theta": 1_000_000.0}})),
    # Phi-4-mini's: longrope over the first 3/4 of each head (12 of 16 dims, 6 frequencies)
    "phi3_partial_longrope": ("phi3", dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                           original_max_position_embeddings=32, partial_rotary_factor=0.75,
                                           rope_scaling={"type": "longrope", "short_factor": _SHORT[:6],
                                                         "long_factor": _LONG[:6]})),
}


def hf_config(model_type: str, **overrides):
    from transformers import AutoConfig

    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                max_position_embeddings=1024, initializer_range=0.1, rms_norm_eps=1e-5,
                bos_token_id=None, eos_token_id=None, pad_token_id=None)
    base.update(overrides)
    return AutoConfig.for_model(model_type, **base)


def build_checkpoint(path: Path, model_type: str, *, seed: int = 0, dtype=torch.float32, **overrides):
    """Saves a random model to `path` (safetensors) and returns the HF model, eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(model_type, **overrides), dtype=dtype).eval()
    with torch.no_grad():  # HF inits norms to one and biases to zero; make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
            elif "norm" in name or ".ln_" in name:  # GPT-2's LayerNorms: ln_1, ln_2, ln_f
                p.normal_(1.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return model
