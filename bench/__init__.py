"""Benchmarks of grpo-service, each run as ``python -m bench.<name>`` (BENCHMARKS.md at the
repository root quotes each command with its figures).

Training:
- ``step_vs_trl``: GRPO step time and peak memory, our trainer (``ours_step``) vs TRL's
  GRPOTrainer (``trl_step``, in TRL's own venv), at equal settings.
- ``rollout_throughput``: the vLLM engine vs the transformers engine, tokens/s.
- ``async_grpo``: asynchronous GRPO at each ``max_staleness`` against the synchronous step.
- ``distributed_step``: two ranks (``distributed_rank``) against one process on this CPU.
- ``agent_rollouts``: agent episodes batched vs one by one, the prefix cache kept vs cleared
  (its engine and tools: ``agent_rollout_parts``).
- ``lora_sync``: LoRA weights into vLLM, merged push vs adapter hot-swap.
- ``kl_study``: the five KL estimators' stability on one task.
- ``gpu_update`` (on a GPU) and ``head_memory`` (on CPU): one GRPO update of a random model of
  given shapes (``update_parts``); ``matmul_dtype``: float32 vs bfloat16 matmuls on this CPU.
- ``python_grader``: the python grader's sandbox pool against an in-process call.

The service:
- ``load_create`` (with ``load_client``, an open-loop HTTP load generator): job creation under
  load; ``metrics_read`` (MLflow's side in ``metrics_read_mlflow``): reading a long job's metrics.
- ``inference`` (its API, worker and inference processes: ``inference_stack``): serving through
  the gateway.
- ``tinker_roundtrip`` (the SDK side: ``tinker_roundtrip_client``): a Tinker round trip's price;
  ``tinker_idle_release``: what an idle release and reload of a training client cost.
- ``chaos``: real processes, real faults, every invariant checked (``chaos_cluster``,
  ``chaos_faults``, ``chaos_jobs``, ``chaos_traffic``, ``chaos_inference``, ``chaos_checks``).
- ``services``: the Postgres and Redis servers the service benchmarks run against.
- ``common``: shared helpers (machine and load snapshots, an RSS sampler, arithmetic prompts).
"""
