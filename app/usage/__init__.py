"""/v1/usage: a project's checkpoint storage and its quotas (checkpoint bytes, active jobs and
their devices), its inference tokens, and its use of the Tinker API."""
