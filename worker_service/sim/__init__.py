"""The simulated accelerator behind `stepahead worker --device sim` (no torch).

- `profiles`: accelerator datasheet numbers (`h100`, `h200`, `a100`, or a JSON file);
- `cost`: the roofline step-time model and the KV pool size;
- `tokens`: the deterministic token rule and its pure-Python reference;
- `runner`: `SimRunner`, the same `launch(plan) -> pending.wait() -> StepResult` interface
  as the torch `ModelRunner`, so the worker daemon runs it unchanged.

See `docs/sim.md`.
"""
