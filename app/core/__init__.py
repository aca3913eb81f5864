"""What every domain of the API shares and nothing of a domain: the database and its unit of work,
the models, settings, errors and their one shape, ids and time, the job statuses, the queue, the
fair-use limits, request guards and API-key hashing. Imports nothing else of `app`."""
