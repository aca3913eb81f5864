"""The rows a job trains on: an upload parsed (JSONL, CSV, Parquet) within the memory budget,
a new job's large inline rows spilled into a file, and the queries of dataset files."""
