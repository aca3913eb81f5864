"""The `grpo` command line: serve, worker, db, keys, train, and the API client commands
(submit, jobs, logs, metrics).

- ``main``: the ``grpo`` entry point and its parser; subcommands import what they need lazily;
- ``__main__``: ``python -m grpo_cli``;
- ``serve``: ``grpo serve``: the API with an embedded worker and inference process;
- ``api``: ``grpo api``: the production API, several uvicorn worker processes;
- ``db``: database migrations through Alembic;
- ``keys``: ``grpo keys``: create, list and revoke API keys on the database;
- ``chat``: ``grpo chat``: talk to a model through the API's chat completions;
- ``ci``: the client commands (``submit``, ``jobs``, ``logs``, ``metrics``, ``download``);
- ``ci_args``: their arguments and exit codes;
- ``ci_env``: what the client commands learn from the environment (address, key, commit);
- ``client``: a small HTTP client for the API;
- ``download``: ``grpo download``: save a checkpoint's model locally;
- ``gates``: quality gates for CI: ``--timeout`` and ``--require`` thresholds;
- ``waiting``: waiting for a job to end, with a progress bar and a deadline;
- ``render``: human-readable text for the client commands;
- ``output``: where a client command writes: text or JSON on stdout, errors on stderr.
"""
