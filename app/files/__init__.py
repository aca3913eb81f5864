"""/v1/files (OpenAI's files API too): upload, list, read and delete a project's datasets, and a
job's result file (its metrics as CSV), served as a file.

- ``routes``: the ``/v1/files`` routes;
- ``schemas``: their response bodies;
- ``deps``: the loader of the file named in the path (or 404);
- ``service``: the project's files: uploaded datasets and a job's result file;
- ``result_files``: a job's result file, its per-step metrics as CSV, read when asked for.
"""
