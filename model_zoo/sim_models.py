"""Built-in models of the simulated worker: published geometry, no weights.

`llama3-8b-sim` and `llama3-70b-sim` are directories with the `config.json` of Meta's
Llama-3-8B / Llama-3-70B (layers, widths, heads, 128,256-entry vocabulary, 8,192
positions, bf16); `llama3.2-1b-sim` that of Llama-3.2-1B (16 layers, tied embeddings,
131,072 positions with llama3 rope scaling), a small model whose decode steps are short and the built-in byte-level BPE tokenizer (4,096 ids, the same as
`tiny`'s), so the gateway can tokenize and the sim worker samples ids below 4,096.
The Mixture-of-Experts ones: `qwen3-30b-a3b-sim` (Qwen/Qwen3-30B-A3B: 48 layers, 128
experts of width 768, top-8, 30.5B parameters, 3.3B active) and `mixtral-8x7b-sim`
(mistralai/Mixtral-8x7B-v0.1: 32 layers, 8 experts of width 14,336, top-2, 46.7B parameters,
12.9B active); the cost model reads the experts a step routes to (`worker_service/sim/cost.py`).
`--device sim` reads only config.json; a torch worker cannot load these (no weights).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model_zoo.tokenizer_train import BOS_TOKEN, EOS_TOKEN, IM_END_TOKEN, PAD_TOKEN, CorpusSpec

TOKENIZER_VOCAB = 4096
TOKENIZER_CORPUS = CorpusSpec(max_bytes=2_000_000)  # the tiny model's: the same tokenizer


@dataclass(frozen=True)
class SimModelSpec:
    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int = 128256
    max_position_embeddings: int = 8192
    rope_theta: float = 500000.0
    model_type: str = "llama"
    architecture: str = "LlamaForCausalLM"
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    extra: tuple[tuple[str, Any], ...] = ()  # further config.json fields (head_dim, the experts')


SIM_MODELS: dict[str, SimModelSpec] = {
    # Meta Llama 3 model card / config.json of meta-llama/Meta-Llama-3-8B and -70B.
    "llama3-8b-sim": SimModelSpec("llama3-8b-sim", 4096, 14336, 32, 32, 8),
    "llama3-70b-sim": SimModelSpec("llama3-70b-sim", 8192, 28672, 80, 64, 8),
    # config.json of meta-llama/Llama-3.2-1B: tied embeddings, head_dim 64, llama3 rope scaling
    "llama3.2-1b-sim": SimModelSpec(
        "llama3.2-1b-sim", 2048, 8192, 16, 32, 8, max_position_embeddings=131072, tie_word_embeddings=True,
        extra=(("head_dim", 64), ("rope_scaling", {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 8192}))),
    # config.json of Qwen/Qwen3-30B-A3B: every layer sparse (intermediate_size is unused)
    "qwen3-30b-a3b-sim": SimModelSpec(
        "qwen3-30b-a3b-sim", 2048, 6144, 48, 32, 4, vocab_size=151936, max_position_embeddings=40960,
        rope_theta=1_000_000.0, model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM", rms_norm_eps=1e-6,
        extra=(("head_dim", 128), ("num_experts", 128), ("num_experts_per_tok", 8), ("moe_intermediate_size", 768),
               ("norm_topk_prob", True), ("decoder_sparse_step", 1), ("mlp_only_layers", []))),
    # config.json of mistralai/Mixtral-8x7B-v0.1
    "mixtral-8x7b-sim": SimModelSpec(
        "mixtral-8x7b-sim", 4096, 14336, 32, 32, 8, vocab_size=32000, max_position_embeddings=32768,
        rope_theta=1_000_000.0, model_type="mixtral", architecture="MixtralForCausalLM",
        extra=(("num_local_experts", 8), ("num_experts_per_tok", 2))),
}


def sim_config(spec: SimModelSpec) -> dict[str, Any]:
    """The model's config.json fields, without the tokenizer's ids."""
    return {
        "architectures": [spec.architecture], "model_type": spec.model_type, "hidden_act": "silu",
        "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers, "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads, "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings, "rope_theta": spec.rope_theta,
        "rms_norm_eps": spec.rms_norm_eps, "tie_word_embeddings": spec.tie_word_embeddings, "torch_dtype": "bfloat16",
        **dict(spec.extra),
    }


def build_sim_model(name: str, out: Path) -> Path:
    """Write config.json, generation_config.json and the tokenizer files into `out`."""
    from model_zoo.tokenizer_train import build_hf_tokenizer

    spec = SIM_MODELS[name]
    tokenizer = build_hf_tokenizer(TOKENIZER_VOCAB, TOKENIZER_CORPUS, spec.max_position_embeddings)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (BOS_TOKEN, EOS_TOKEN, IM_END_TOKEN, PAD_TOKEN)}
    config = {
        **sim_config(spec),
        "bos_token_id": ids[BOS_TOKEN], "eos_token_id": ids[EOS_TOKEN], "pad_token_id": ids[PAD_TOKEN],
        "stepahead_sim_only": True,  # geometry only: no weights in this directory
    }
    generation = {"bos_token_id": ids[BOS_TOKEN], "eos_token_id": [ids[EOS_TOKEN], ids[IM_END_TOKEN]],
                  "pad_token_id": ids[PAD_TOKEN]}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
    tokenizer.save_pretrained(out)
    return out
