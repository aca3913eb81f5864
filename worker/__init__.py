"""The Celery worker: claims jobs, runs the trainer, reports progress to the database."""
