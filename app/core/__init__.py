"""What every domain of the API shares and nothing of a domain: the database and its unit of work,
the models, settings, errors and their one shape, ids and time, the job statuses, the queue, the
fair-use limits, request guards and API-key hashing. Imports nothing else of `app`.

- ``db``: the engine, the session factory and the unit of work that ends every transaction;
- ``model_base``: the declarative base every table is declared on;
- ``models``: the SQLAlchemy tables of projects, keys, jobs and what a job produces;
- ``tinker_tables``: the tables of the Tinker API (sessions, models, requests, saves);
- ``new_rows_repository``: inserting a new row with one Core INSERT;
- ``projects_repository``: project row locks, which keep per-project counts exact;
- ``settings``: the settings of the API and of the shared persistence and queue;
- ``gateway_settings``: the settings of the inference gateway (``GRPO_INFERENCE_*``);
- ``size_class_settings``: the settings of the workers' size classes the API reads;
- ``tinker_settings``: the settings of the Tinker API (``GRPO_TINKER_*``);
- ``state``: what a running API process holds;
- ``deps``: the FastAPI dependencies every domain shares;
- ``errors``: domain errors carrying their HTTP status;
- ``error_handlers``: the one error shape every error is rendered in;
- ``responses``: the error body and the error responses documented on every route;
- ``field_paths``: where in a request a validation error is, as users write it;
- ``ids``: object ids that sort by creation time;
- ``clock``: timezone-aware UTC time in one place;
- ``job_status``: the statuses a job can be in;
- ``queue``: sending jobs to workers, and withdrawing a cancelled job's messages;
- ``broker_order``: the embedded broker reading queues in the order a worker names them;
- ``live``: the live tail of a job (a Redis stream the event streams wait on);
- ``ratelimit``: fair use per API key: the request rate limit and the process's counters;
- ``leases``: amounts held against budgets every API process shares;
- ``capacity``: the answer (429 or 503) when a shared capacity of the process is full;
- ``limits``: the request body size limit, checked while the body streams in;
- ``request_guard``: refusing request text the database cannot store;
- ``log_redaction``: credentials kept out of the access log;
- ``security``: API keys and their hashing;
- ``session_tokens``: the dashboard's signed sign-in token.
"""
