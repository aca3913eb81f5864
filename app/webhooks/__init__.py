"""Webhooks (docs/webhooks.md): the protocol (event types, signing), where one may be sent, a
project's endpoints and their routes, the transactional outbox a job event fills, and the queries
of endpoints, deliveries and attempts. The worker's sender (worker.webhooks) delivers them."""
