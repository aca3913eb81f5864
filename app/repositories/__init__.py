"""Queries, one module per aggregate: every SELECT, INSERT, UPDATE and DELETE of the service lives
here (tests/test_architecture.py enforces it). No business rules and no commits: a repository
function flushes at most, and the request or task boundary commits."""
