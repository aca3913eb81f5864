"""The Celery worker: claims jobs, runs the trainer, reports progress to the database.

- ``main``: starting a worker process: maintenance and webhook threads and a Celery worker;
- ``celery_app``: the worker's Celery app;
- ``settings``: the worker's settings;
- ``context``: what a worker process holds while it runs;
- ``runner``: one job attempt: claim the lease, train with database callbacks, end the job;
- ``lease``: the lease of a running attempt, as the worker process holds it;
- ``heartbeat``: the heartbeat process that keeps a running job's lease;
- ``attempts``: the fenced ways a job attempt ends;
- ``stop_reasons``: why a run stops before its last step, and which failures are retried;
- ``progress``: the trainer's callbacks, written to the database;
- ``retention``: a running job's checkpoint retention;
- ``retry``: database work retried through a short outage;
- ``maintenance``: periodic repairs that make the queue lossless (reaper, re-dispatch sweep);
- ``webhooks``: webhook delivery from the outbox;
- ``job_exports``: a job attempt's experiment-tracker exports;
- ``trackers``: the tracker exports themselves (MLflow, Weights & Biases);
- ``agents``: http tools and http environments of agent jobs;
- ``tinker_model``: holding a Tinker training model resident and applying its calls;
- ``tinker_requests``: one method per kind of call of a held Tinker model;
- ``tinker_saves``: the saves of a held Tinker model;
- ``tinker_lease``: the lease a worker holds on a Tinker model's row;
- ``tinker_idle``: idle release: an idle Tinker model written to disk and its worker freed;
- ``tinker_upkeep``: the Tinker API's share of the workers' maintenance.
"""
