"""The gateway side of serving the trained models (docs/inference.md): the model catalogue
(GET /v1/models, GET /v1/models/{model}) and the resolution of a model name (a packaged base
model, a job's `ft:` name, a checkpoint's `ft:...:ckpt-step-N`, a native job id with or without
`@step`) to what would serve it (app.gateway.service.resolve_model); and chat and completions
(POST /v1/chat/completions, /v1/completions): bounded request bodies (request_schemas, their
parts request_parts), a chat written as its model was trained and its tool calls read back
(chat_as_trained), the request shapes the engines cannot serve safely (engine_limits) or at all
(capabilities), the choice of an inference process and the ensure call (routing), the proxy to
its vLLM server (proxy, stream, answer), the daily token quota and usage (quota,
usage_repository). The routes are app.gateway.routes, the model objects they answer
app.gateway.schemas, and the registry of inference processes the gateway routes by
app.gateway.servers_repository. What the gateway and an inference process say to each other
is app.gateway.protocol; the engine options and the kinds of served weights with their names,
which both sides read, are app.gateway.engine_identity and app.gateway.served_kinds. The
inference tier itself is the top-level package `inference/` (`grpo inference`), which nothing
here imports."""
