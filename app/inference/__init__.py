"""The gateway side of the "serving the trained model" wing (issue 26). Today it owns the model
catalogue (GET /v1/models, GET /v1/models/{model}) and the resolution of a model name (a
packaged base model, a job's `ft:` name, a checkpoint's `ft:...:ckpt-step-N`, a native job id
with or without `@step`) to what would serve it (app.inference.service.resolve_model); later
the chat and completions routes, which resolve their `model` the same way."""
