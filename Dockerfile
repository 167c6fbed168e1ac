# One image for the API and the GPU worker. Build: docker build -t gspo-service .
# The worker needs the `gpu` extra (CUDA vLLM) and an NVIDIA runtime; the API runs fine without a GPU.
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
# bubblewrap: the sandbox of tenants' `python` graders (see scripts/system-deps.sh for a host install).
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev python3-gdbm \
        build-essential bubblewrap ca-certificates curl && rm -rf /var/lib/apt/lists/*
# The grader environment (requirements-graders.txt), bound read-only into every sandbox; the OS's python3
# and /opt are readable by the sandbox's unprivileged uid.
COPY requirements-graders.txt /tmp/requirements-graders.txt
RUN python3 -m venv /opt/graders && /opt/graders/bin/pip install -r /tmp/requirements-graders.txt
ENV GSPO_GRADER_PYTHON=/opt/graders/bin/python
# The environments venv (requirements-envs.txt) that verifiers environments run in, apart from the service's (its
# openai and mcp pins are below ours); a derived image adds the operator's allowed environment packages with
# /opt/envs/bin/pip and names them in GSPO_VERIFIERS_ENVIRONMENTS (docs/environments.md).
COPY requirements-envs.txt /tmp/requirements-envs.txt
RUN python3 -m venv /opt/envs && /opt/envs/bin/pip install -r /tmp/requirements-envs.txt
ENV GSPO_ENVS_PYTHON=/opt/envs/bin/python
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
# Runs as root so that each sandbox gets a throw-away uid of its own; the data stays root's only (0700).
RUN mkdir -p -m 0700 /data
ENV GSPO_DATA_DIR=/data GSPO_MODELS_DIR=/models
EXPOSE 8000
CMD ["gspo", "api", "--host", "0.0.0.0", "--port", "8000"]
