"""/v1/files (OpenAI's files API too): upload, list, read and delete a project's datasets, and a
job's result file (its metrics as CSV), served as a file."""
