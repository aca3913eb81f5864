"""The `grpo` command line: serve, worker, db, keys, train, and the API client commands
(submit, jobs, logs, metrics)."""
