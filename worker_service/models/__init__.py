"""Model registry: `model_type` from config.json -> its family's declarations (torch-free).

Adding an architecture: a family file (a `ModelFamily`, see `interface.py`), the torch
modules it names, and one line here.
"""

from __future__ import annotations

from worker_service.models.gemma_spec import GEMMA2, GEMMA3_TEXT
from worker_service.models.gpt2_spec import GPT2
from worker_service.models.interface import ModelFamily
from worker_service.models.llama_spec import LLAMA, MISTRAL, QWEN2, QWEN3
from worker_service.models.moe_spec import MIXTRAL, QWEN3_MOE
from worker_service.models.olmo2_spec import OLMO2
from worker_service.models.phi3_spec import PHI3

FAMILIES: dict[str, ModelFamily] = {f.model_type: f for f in (LLAMA, MISTRAL, QWEN2, QWEN3, PHI3, OLMO2,
                                                                     GPT2)}
FAMILIES.update({f.model_type: f for f in (QWEN3_MOE, MIXTRAL)})  # Mixture of Experts (moe_spec.py)
FAMILIES.update({f.model_type: f for f in (GEMMA2, GEMMA3_TEXT)})  # Gemma 2, Gemma 3 text (gemma_spec.py)


def family(model_type: str) -> ModelFamily:
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise ValueError(
            f"unknown model_type {model_type!r}; supported: {sorted(FAMILIES)}"
        ) from None


def model_class(model_type: str) -> type:
    """The torch model class of `model_type` (imports torch)."""
    return family(model_type).model_class()
