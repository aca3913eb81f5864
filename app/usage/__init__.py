"""/v1/usage: a project's checkpoint storage and its quotas (checkpoint bytes, active jobs and
their devices)."""
