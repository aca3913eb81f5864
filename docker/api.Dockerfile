# The API image: FastAPI + SQLAlchemy + Celery producer. No torch, no model libraries.

# The dashboard's chart library comes from npm; node stays in this stage, out of the image.
FROM node:22-slim AS dashboard
WORKDIR /build/dashboard
COPY dashboard/package.json dashboard/package-lock.json ./
RUN npm ci --no-audit --no-fund --omit=dev
COPY dashboard/index.html dashboard/style.css dashboard/app.js dashboard/api.js dashboard/dom.js \
     dashboard/job.js dashboard/job_parts.js dashboard/rollouts.js dashboard/chat.js dashboard/spec.js \
     dashboard/charts.js dashboard/docs.html dashboard/docs.js dashboard/tinker.js ./

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
# POST /v1/graders/run runs python graders in the same bubblewrap sandbox as the workers.
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap libseccomp2 \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /srv/grpo
COPY pyproject.toml README.md alembic.ini ./
COPY app ./app
# The torch-free ground the API stands on: the job spec (with the model-folder rule and the
# names of a checkpoint's trainer-only files), the graders (each type's spec and runtime, their
# templates, formulas, sandbox, subprocess pool, and the operator endpoints' registry and client,
# which admission and POST /v1/graders/run use) and the strict model both derive from (specbase).
# Nothing of trainer/.
COPY jobspec ./jobspec
COPY grading ./grading
COPY specbase ./specbase
COPY grpo_cli ./grpo_cli
COPY migrations ./migrations
COPY worker/__init__.py ./worker/__init__.py
COPY --from=dashboard /build/dashboard ./dashboard
RUN pip install ".[api,graders]" \
    && python -c "import sys, app.main; assert 'torch' not in sys.modules"
RUN useradd --create-home --uid 10001 grpo
USER grpo
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --retries=5 \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2)"
# Several API processes (the API is CPU-bound Python): GRPO_API_WORKERS, by default 2 per core
# and at most 4. Each process keeps its own database pool (see README, "Production").
CMD ["grpo", "api", "--host", "0.0.0.0", "--port", "8000"]
