"""The `grpo` command line: serve, worker, db, keys, train."""
