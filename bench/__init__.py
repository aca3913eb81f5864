"""Benchmarks of grpo-service (see BENCHMARKS.md at the repository root).

- ``python -m bench.rollout_throughput``: vLLM vs transformers rollout tokens/s.
- ``python -m bench.step_vs_trl``: GRPO step time and peak RSS, our trainer vs TRL's GRPOTrainer.
"""
