"""Tensor parallelism: one model sharded over the k ranks of a `torch.distributed` group.

- `geometry.py`: which slice of each checkpoint tensor a rank holds; refuses a geometry
  that does not divide, naming the dimension.
- `group.py`: the process group (gloo on CPU, NCCL on CUDA) and its teardown.
- `layers.py`: row-parallel linears (one all-reduce each), the vocab-parallel embedding
  and the lm_head whose logits are gathered on rank 0.
- `loader.py`: builds the rank's shard, reading only its slices (`safe_open().get_slice`).
- `runner.py`: `TPModelRunner`, a `ModelRunner` whose rank 0 samples and broadcasts the ids.

Nothing here is imported on the single-device path (k = 1).
"""
