"""`TPModelRunner`: one rank of a tensor-parallel group executing the group's plans.

Every rank receives the same plan and runs the same forward on its shard (the collectives
are in `layers.py`). Rank 0 alone samples, on the gathered logits; it then broadcasts the
sampled ids `[num_sampling]` inside the step, so every rank keeps the same ids on its
device for the next step's placeholder decodes. A row whose sampling failed on rank 0 is
broadcast as -1: every rank then forgets that request alike, so later plans stay
identical on all ranks. Only rank 0's result goes to the scheduler (see
`worker_service/attach.py`); the others' results are discarded.

The KV pool has the same number of blocks on every rank (the minimum over ranks).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from worker_service.input_batch import RequestTable
from worker_service.kv_cache import KVCache
from worker_service.model_runner import ModelRunner
from worker_service.parallel.loader import load_shard


class TPModelRunner(ModelRunner):
    def __init__(self, model_dir, *, rank: int, size: int, expert_parallel: bool = False, **kwargs):
        self.rank, self.tp_size, self.expert_parallel = rank, size, expert_parallel
        super().__init__(model_dir, **kwargs)
        self._agree_on_pool()

    def _load_model(self, model_dir):
        return load_shard(model_dir, self.dtype, self.device, self.rank, self.tp_size, self.expert_parallel)

    def _agree_on_pool(self) -> None:
        """Device and host block counts := their minimum over the ranks."""
        counts = torch.tensor([self.num_blocks, self.num_host_blocks], dtype=torch.int64, device=self.device)
        dist.all_reduce(counts, op=dist.ReduceOp.MIN)
        num_blocks, num_host = (int(c) for c in counts.tolist())
        if (num_blocks, num_host) == (self.num_blocks, self.num_host_blocks):
            return
        self.num_blocks, self.num_host_blocks = num_blocks, num_host
        self.num_offload_blocks = min(self.num_offload_blocks, num_host)
        self.kv_cache = KVCache(self.model.config, num_blocks=num_blocks, num_host_blocks=num_host,
                                block_size=self.block_size, dtype=self.dtype, device=self.device)
        self.table = RequestTable(self.max_blocks_per_req, self.kv_cache.dummy_block)

    def _sample(self, logits, reqs):
        """Rank 0: sample `logits [n, vocab]` and broadcast; others: receive the ids `[n]`."""
        if self.rank == 0:
            sampled, good, failed = super()._sample(logits, reqs)
            if reqs:
                dist.broadcast(_with_holes(sampled, good, reqs), src=0)
            return sampled, good, failed
        self.last_logits, self.last_logits_ids = None, ()
        rows = torch.empty(len(reqs), dtype=torch.int64, device=self.device)  # [n]
        if not reqs:
            return rows, [], {}
        dist.broadcast(rows, src=0)
        bad = (rows < 0).tolist()  # a host read: rare failures must be known before the next plan
        if not any(bad):
            return rows, list(reqs), {}
        keep = [i for i, b in enumerate(bad) if not b]
        failed = {reqs[i].request_id: "sampling failed on tensor-parallel rank 0" for i, b in enumerate(bad) if b}
        return rows[keep], [reqs[i] for i in keep], failed


def _with_holes(sampled: torch.Tensor, good: list, reqs: list) -> torch.Tensor:
    """sampled `[len(good)]` spread over `[len(reqs)]` rows, -1 where a row failed."""
    if len(good) == len(reqs):
        return sampled.contiguous()
    rows = torch.full((len(reqs),), -1, dtype=torch.int64, device=sampled.device)
    index = {id(r): i for i, r in enumerate(reqs)}
    where = torch.tensor([index[id(r)] for r in good], dtype=torch.int64, device=sampled.device)
    return rows.index_copy_(0, where, sampled)
