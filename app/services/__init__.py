"""Business rules of the API: what may happen to jobs, keys and files."""
