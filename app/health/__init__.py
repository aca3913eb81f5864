"""Liveness and readiness: the probes of the database and the broker."""
