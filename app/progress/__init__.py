"""What a job produces while it runs: metrics, samples, checkpoints (their routes, queries
and download), and the live event streams (SSE) of one job and of a project."""
