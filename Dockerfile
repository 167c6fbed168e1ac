# One image for the API and the GPU worker. Build: docker build -t gspo-service .
# The worker needs the `gpu` extra (CUDA vLLM) and an NVIDIA runtime; the API runs fine without a GPU.
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
        ca-certificates curl && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /app
COPY pyproject.toml README.md ./
COPY gspo_core gspo_core
COPY api api
COPY worker worker
COPY store store
COPY gspo_client gspo_client
COPY gspo_cli gspo_cli
COPY migrations migrations
RUN pip install -e '.[gpu]'
# The sandboxed `python` grader drops to this unprivileged user for user code.
RUN useradd --system --uid 10001 gspo && mkdir -p /data && chown gspo /data
ENV GSPO_DATA_DIR=/data GSPO_MODELS_DIR=/models
EXPOSE 8000
CMD ["gspo", "api", "--host", "0.0.0.0", "--port", "8000"]
