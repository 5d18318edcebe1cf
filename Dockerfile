# syntax=docker/dockerfile:1
# One image for every pipefb role; the Kubernetes manifests choose the role by `command`:
#   python -m coordinator | python -m worker | pipefb submit ... (CMD: the coordinator).
#   docker build --build-arg TORCH=cpu  -t pipefb:cpu  .   # torch from the CPU wheel index
#   docker build --build-arg TORCH=cuda -t pipefb:cuda .   # torch's CUDA build (PyPI's Linux wheel)
# Stages: protos (generates the gRPC/protobuf code from protos/*.proto), build (a venv with
# torch and pipefb), runtime (the venv only, non-root). tests/test_dockerfile.py checks it.
ARG PYTHON=3.11

FROM python:${PYTHON}-slim-bookworm AS protos
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN pip install grpcio-tools==1.85.1
WORKDIR /src
COPY protos/__init__.py protos/generate.py protos/*.proto protos/
RUN python -m protos.generate

FROM python:${PYTHON}-slim-bookworm AS build
# cpu or cuda; TORCH_INDEX overrides the wheel index (e.g. .../whl/cu128 for one CUDA version)
ARG TORCH=cpu
ARG TORCH_INDEX=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first and pinned, so installing pipefb finds it satisfied and pulls no other build
RUN case "$TORCH" in \
      cpu) index="${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}" ;; \
      cuda) index="${TORCH_INDEX:-https://pypi.org/simple}" ;; \
      *) echo "TORCH must be cpu or cuda, not '$TORCH'" >&2; exit 1 ;; \
    esac \
    && pip install --index-url "$index" torch==2.13.0
WORKDIR /src
COPY pyproject.toml README.md ./
COPY pipefb pipefb
COPY protos protos
COPY coordinator coordinator
COPY worker worker
COPY offload_store offload_store
COPY dataplane dataplane
COPY calibration calibration
COPY --from=protos /src/protos/*_pb2.py /src/protos/*_pb2_grpc.py protos/
RUN pip install . && cd / && python -c "import coordinator.service, worker.service, pipefb.app.cli"

FROM python:${PYTHON}-slim-bookworm AS runtime
RUN groupadd --gid 10001 pipefb \
    && useradd --uid 10001 --gid 10001 --home-dir /tmp --no-create-home \
       --shell /usr/sbin/nologin pipefb
COPY --from=build /opt/venv /opt/venv
# HOME is /tmp: the pods mount an emptyDir there under a read-only root filesystem
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/tmp
WORKDIR /tmp
USER 10001:10001
# gRPC (coordinator and workers), Prometheus metrics, the all-reduce rendezvous (coordinator)
EXPOSE 50051 9090 29500
CMD ["python", "-m", "coordinator"]
