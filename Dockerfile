# treadle images. Neither is built by CI or on the development machines (no Docker
# engine there): both are kept short so that they are easy to check by eye.
#
# Server (CPU), the default target:
#   docker build -t treadle .
#   docker run -p 50051:50051 -p 50052:50052 -v $PWD/models:/models -v treadle-data:/data \
#     treadle serve --model /models/my-model --host 0.0.0.0 --data-dir /data
#
# GPU worker (CUDA, torch engine on the GPU, the vLLM sampler available):
#   docker build --target worker-gpu -t treadle-worker-gpu .
#   docker run --gpus all -v /models:/models -v /scratch:/scratch treadle-worker-gpu \
#     --model llama-1b=/models/llama-1b --broker redis://... --database-url postgresql+psycopg://... \
#     --store s3://bucket/prefix --data-dir /scratch/treadle

# ---- GPU worker ------------------------------------------------------------------
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04 AS worker-gpu

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    PATH=/opt/venv/bin:$PATH
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
WORKDIR /opt/treadle

# vllm pins its CUDA build of torch; the [vllm] extra brings it.
COPY pyproject.toml README.md ./
COPY client_sdk ./client_sdk
COPY server ./server
COPY workers ./workers
COPY migrations ./migrations
RUN pip install ".[server,vllm]"

RUN useradd --create-home treadle && mkdir -p /scratch && chown treadle /scratch
USER treadle
ENTRYPOINT ["treadle", "worker", "--device", "cuda"]

# ---- server (CPU): the last stage, what a plain `docker build` makes ---------------
FROM python:3.11-slim AS base

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /opt/treadle

# torch first, from the CPU index, so the [server] extra does not pull a CUDA build.
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"

COPY pyproject.toml README.md ./
COPY client_sdk ./client_sdk
COPY server ./server
COPY workers ./workers
COPY migrations ./migrations
RUN pip install ".[server]"

RUN useradd --create-home treadle && mkdir -p /data && chown treadle /data
USER treadle
VOLUME ["/data"]
EXPOSE 50051 50052
ENTRYPOINT ["treadle"]
CMD ["serve", "--host", "0.0.0.0", "--data-dir", "/data"]

