"""Webhooks (docs/webhooks.md): the protocol (event types, signing), where one may be sent, a
project's endpoints and their routes, the transactional outbox a job event fills, and the queries
of endpoints, deliveries and attempts. The worker's sender (worker.webhooks) delivers them.

- ``protocol``: event types, payload shape, signing secrets and signatures;
- ``urls``: where a webhook may be sent;
- ``routes``: the ``/v1/webhooks`` routes;
- ``schemas``: their request and response bodies;
- ``deps``: the loader of the endpoint named in the path (or 404);
- ``service``: a project's endpoints and their delivery log, with redelivery;
- ``outbox``: the transactional outbox a job event fills;
- ``repository``: the queries of endpoints, deliveries and attempts.
"""
