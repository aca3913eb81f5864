"""The rows a job trains on: an upload parsed (JSONL, CSV, Parquet) within the memory budget,
a new job's large inline rows spilled into a file, and the queries of dataset files.

- ``upload_rows``: the rows of an uploaded JSONL, CSV or Parquet file, validated row by row;
- ``parquet_rows``: the rows of a Parquet file, read within the memory budget;
- ``service``: a new job's large inline rows stored as a file of the project;
- ``repository``: the queries of uploaded dataset files.
"""
