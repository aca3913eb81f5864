"""What a job produces while it runs: metrics, samples, checkpoints (their routes, queries
and download), and the live event streams (SSE) of one job and of a project.

- ``routes``: the routes of a job's metrics, samples, checkpoints and live stream;
- ``schemas``: their response bodies;
- ``repository``: the writes and reads of metrics, samples and checkpoints;
- ``metrics``: metric series for charts and CI, downsampled or raw;
- ``metrics_repository``: the metric rollups written beside each step, and the reads on them;
- ``checkpoint_download``: a checkpoint streamed as a tar archive;
- ``stream``: the server-sent events of one job;
- ``project_stream``: the server-sent event stream of a project (``GET /v1/stream``).
"""
