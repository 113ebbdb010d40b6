"""Model registry: `model_type` from config.json -> model class."""

from __future__ import annotations

from worker_service.model_config import SUPPORTED_MODEL_TYPES
from worker_service.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}


assert tuple(MODEL_REGISTRY) == SUPPORTED_MODEL_TYPES, "worker_service.model_config names the same types"


def model_class(model_type: str) -> type[LlamaForCausalLM]:
    try:
        return MODEL_REGISTRY[model_type]
    except KeyError:
        raise ValueError(
            f"unknown model_type {model_type!r}; supported: {sorted(MODEL_REGISTRY)}"
        ) from None
