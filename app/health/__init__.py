"""Liveness and readiness: the probes of the database and the broker.

- ``routes``: the liveness and readiness routes;
- ``schemas``: their response bodies;
- ``probes``: the probes of the database and the broker, each bounded to about a second;
- ``repository``: the readiness probe's query.
"""
