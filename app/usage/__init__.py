"""/v1/usage: a project's checkpoint storage and its quotas (checkpoint bytes, active jobs and
their devices), its inference tokens, and its use of the Tinker API.

- ``routes``: the ``/v1/usage`` route;
- ``schemas``: its response bodies;
- ``service``: the per-project checkpoint storage quota.
"""
