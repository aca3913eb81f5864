"""Queries, one module per aggregate. No business rules and no commits here."""
