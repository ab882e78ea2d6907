# treadle server image (CPU). Build: docker build -t treadle .
# Run:   docker run -p 50051:50051 -p 8080:8080 -v $PWD/models:/models -v treadle-data:/data \
#          treadle serve --model /models/my-model --host 0.0.0.0 --data-dir /data
# A GPU worker image (vLLM) is a later target.
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
EXPOSE 50051 8080
ENTRYPOINT ["treadle"]
CMD ["serve", "--host", "0.0.0.0", "--data-dir", "/data"]
