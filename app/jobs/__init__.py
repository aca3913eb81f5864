"""Jobs (/v1/jobs): the idempotent create (service.JobCreation), admission, the state machine
(transitions: the only code that changes a job's status), dispatch to the queue, pause and
resume, deletion, and the queries of jobs, their events, checkpoints and idempotency records.

- ``routes``: the ``/v1/jobs`` routes;
- ``schemas``: their response bodies;
- ``presenters``: ORM rows turned into API bodies;
- ``deps``: the loader of the job named in the path (or 404) and the process's create;
- ``service``: the job rules: create, read, cancel;
- ``idempotency``: the ``Idempotency-Key`` of a create: its claim, release and replay;
- ``idempotency_repository``: the queries of idempotency records;
- ``admission``: what a valid spec may still not ask of this deployment;
- ``capabilities``: the dry run's warning about checkpoints the inference tier cannot serve;
- ``quota``: a project's quota of active jobs and their devices;
- ``size_classes``: whether any worker runs a job of this size, and the warnings when none does;
- ``transitions``: the job state machine, the only code that assigns ``jobs.status``;
- ``dispatch``: sending jobs to their queue, fairly between projects;
- ``slots_repository``: fair dispatch's queries (the slots a project's jobs hold);
- ``pausing``: pause and resume;
- ``deletion``: deleting an ended job;
- ``deletion_repository``: the deletion mark and the purge after the grace period;
- ``repository``: the queries of jobs;
- ``events_repository``: the queries of a job's events;
- ``checkpoints_repository``: checkpoint queries for admission, retention and usage;
- ``servers_repository``: what the inference processes' registry rows say of the LoRA rank served;
- ``workers_repository``: worker sightings: the size classes seen lately.
"""
