"""grpo-service HTTP API: FastAPI routes, job rules, persistence. Never imports torch.

- ``main``: the FastAPI application factory (``app.main:create_app``, what uvicorn serves);
- ``core``: what every domain shares: the database, the tables, settings, errors, ids, the
  queue, fair-use limits, request guards and API-key hashing;
- ``dashboard``: the web dashboard's static files (the ``dashboard/`` folder), served at ``/``;
- ``datasets``: the rows a job trains on: uploads parsed within a memory budget, large inline
  rows spilled into a file;
- ``files``: ``/v1/files``: a project's uploaded datasets and a job's result file;
- ``fine_tuning``: OpenAI's fine-tuning API (``/v1/fine_tuning``) over native jobs;
- ``graders``: ``/v1/graders``: try a grader on a sample before a job;
- ``health``: liveness and readiness probes;
- ``gateway``: the inference gateway: ``/v1/models``, chat and completions;
- ``jobs``: ``/v1/jobs``: create, admission, the state machine, dispatch, pause, deletion;
- ``progress``: what a running job produces (metrics, samples, checkpoints) and the live streams;
- ``sessions``: projects, API keys, the dashboard's sign-in and the authenticated caller;
- ``tinker``: the Tinker training API, the protocol of the official ``tinker`` SDK;
- ``usage``: ``/v1/usage``: a project's storage, quotas, inference tokens and Tinker use;
- ``webhooks``: a project's webhook endpoints, their protocol and the delivery outbox.
"""
