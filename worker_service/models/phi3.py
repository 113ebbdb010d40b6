"""Phi-3 / Phi-4 (`model_type` "phi3"): the Llama decoder of `llama.py`, unchanged; its
checkpoint's fused tensors are the declarations' business (`phi3_spec.py`)."""

from __future__ import annotations

from worker_service.models.llama import LlamaForCausalLM
from worker_service.models.phi3_spec import PHI3, Phi3Family


class Phi3ForCausalLM(LlamaForCausalLM):
    family: Phi3Family = PHI3
