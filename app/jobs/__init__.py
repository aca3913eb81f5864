"""Jobs (/v1/jobs): the idempotent create (service.JobCreation), admission, the state machine
(transitions: the only code that changes a job's status), dispatch to the queue, pause and
resume, deletion, and the queries of jobs, their events, checkpoints and idempotency records."""
