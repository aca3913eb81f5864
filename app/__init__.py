"""grpo-service HTTP API: FastAPI routes, job rules, persistence. Never imports torch."""
