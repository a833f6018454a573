# The kvgate image: one program, three roles — `kvgate serve` (engine), `kvgate epp`, `kvgate operator`.
# CPU by default; for NVIDIA GPUs build with the CUDA wheels of torch (they carry the CUDA runtime; the node
# needs only the driver):  docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    KVGATE_CACHE_DIR=/var/cache/kvgate

# torch first and pinned, from the chosen wheel index, so the package install below does not replace it.
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"

# Every folder pyproject.toml's package-dir names (tests/test_packaging.py builds exactly this set).
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvgate ./kvgate
COPY common ./common
COPY stack ./stack
COPY bench ./bench
COPY engine ./engine
COPY epp ./epp
COPY operator ./operator
COPY conformance ./conformance
RUN pip install --no-cache-dir . && rm -rf /src

# Non-root; the engine writes only to its cache (an emptyDir in the pods the operator makes).
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin kvgate \
    && mkdir -p /var/cache/kvgate && chown 10001 /var/cache/kvgate
USER 10001
WORKDIR /home
ENTRYPOINT ["kvgate"]
CMD ["--help"]
