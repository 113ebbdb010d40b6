"""The layers the model families share (torch): norms, activations, MLPs, rotary embeddings,
attention over the paged KV cache and the Mixture-of-Experts block.

A family's model file (`worker_service/models/<family>.py`) composes these with its own
module names and its declarations (`<family>_spec.py`). Each layer takes plain sizes and
options, never a `ModelConfig` nor a family, and no module here imports `worker_service.models`
(tests/unit/test_layering.py): the layers sit below the models. Shapes in the comments:
n tokens, H query heads, KVH key/value heads, d head_dim, E experts, I an expert's width.

- `norm.py`: RMSNorm (HF Llama's rounding; OLMo 2's scale in float32), Gemma's `(1 + w)`
  RMSNorm, LayerNorm
- `activation.py`: the MLP activations by config.json name (`ACTIVATIONS`)
- `mlp.py`: the gated MLP (SwiGLU, GeGLU; gate and up fused) and the plain two-matmul MLP
- `rotary.py`: the rotary table of every `rope_type`, `apply_rotary`
- `attention.py`: `ForwardContext` (a step's inputs to every layer), `Attention` (fused qkv,
  optional biases, q/k norm per head or over the whole width, rope, sliding window, logit
  soft-capping, attention sinks) and `paged_attention` (write K/V, attend) for a family that
  projects its own q/k/v
- `moe.py`: stacked experts run batched per expert, the router + experts block
- `packed_linear.py`: CPU linears with their weights packed for oneDNN's matmul (the runner
  swaps them in at load on CPU, eager)
"""
