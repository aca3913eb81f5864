"""The rollout engines: what samples a step's completions (docs/trainer.md, "Rollout engines").

- ``base``: the engine interface and the sampling semantics every engine follows;
- ``registry``: the engines by name (``rollout.engine``) and :func:`make_engine`;
- ``startup``: starting a run's engine, with a vLLM KV cache sized to what the run generates;
- ``colocation``: the trainer and vLLM on one GPU: the engine's share and when it sleeps;
- ``stop_tokens``: which token ids end a completion (every end token the model declares);
- ``hf_engine``: rollout with transformers ``generate``, the fallback and reference engine;
- ``vllm_engine``: rollout with an in-process vLLM engine (the only module that imports vllm);
- ``vllm_config``: the vLLM engine's arguments, its device and each request's seed (no vllm
  import);
- ``vllm_process``: what the vLLM engine must leave of the trainer's process (its random streams
  and default process group);
- ``vllm_weights``: weights and LoRA adapter folders on their way into the vLLM engine;
- ``rollout_server``: one engine in a process of its own, served over HTTP (async GRPO);
- ``rollout_service``: the rollout server's engine side: its config and the version each call
  gets;
- ``remote_engine``: the client of a rollout server, an engine the trainer updates beside;
- ``remote_start``: starting a run's rollout server, sized as an in-process engine;
- ``weight_versions``: published weight versions, the files through which the client hands a
  rollout server its weights.

Nothing is imported here, so that a module of this package loads only what it imports itself
(vllm only through ``vllm_engine``).
"""
