# syntax=docker/dockerfile:1
# One image for every pipefb role; the Kubernetes manifests choose the role by `command`:
#   python -m coordinator | python -m worker | pipefb submit ... (CMD: the coordinator).
#   docker build --build-arg TORCH=cpu  -t pipefb:cpu  .   # torch from the CPU wheel index
#   docker build --build-arg TORCH=cuda -t pipefb:cuda .   # torch's CUDA build (PyPI's Linux wheel)
# Without a registry or behind a TLS-inspecting proxy (docs/deploy.md, "Building the image"):
#   --build-context wheels=DIR   wheels pip prefers to any index (e.g. the CPU torch wheel)
#   --secret id=ca,src=FILE      a CA bundle pip trusts (the proxy's), never stored in a layer
# Stages: wheels (empty unless --build-context wheels=DIR replaces it), protos (generates
# the gRPC/protobuf code from protos/*.proto), deps (a venv with torch and the other
# dependencies), build (pipefb itself into /opt/pipefb), runtime (the venv and /opt/pipefb,
# non-root): a source change rebuilds and copies pipefb alone. tests/test_dockerfile.py
# checks it; scripts/test_container.sh builds it.
ARG PYTHON=3.11

FROM scratch AS wheels

FROM python:${PYTHON}-slim-bookworm AS protos
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_FIND_LINKS=/wheels
RUN --mount=type=bind,from=wheels,target=/wheels --mount=type=secret,id=ca,required=false \
    PIP_CERT="$(test -f /run/secrets/ca && echo /run/secrets/ca)" \
    pip install grpcio-tools==1.85.1
WORKDIR /src
COPY protos/__init__.py protos/generate.py protos/*.proto protos/
RUN python -m protos.generate

FROM python:${PYTHON}-slim-bookworm AS deps
# cpu or cuda; TORCH_INDEX overrides the wheel index (e.g. .../whl/cu128 for one CUDA version,
# or https://pypi.org/simple when the CPU wheel comes from --build-context wheels=DIR)
ARG TORCH=cpu
ARG TORCH_INDEX=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_FIND_LINKS=/wheels
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first and pinned, so installing the rest finds it satisfied and pulls no other build;
# a CPU image that got a CUDA build (the CPU wheel missing from DIR) fails here
RUN --mount=type=bind,from=wheels,target=/wheels --mount=type=secret,id=ca,required=false \
    case "$TORCH" in \
      cpu) index="${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}" ;; \
      cuda) index="${TORCH_INDEX:-https://pypi.org/simple}" ;; \
      *) echo "TORCH must be cpu or cuda, not '$TORCH'" >&2; exit 1 ;; \
    esac \
    && PIP_CERT="$(test -f /run/secrets/ca && echo /run/secrets/ca)" \
       pip install --index-url "$index" torch==2.13.0 \
    && python -c "import sys, torch; sys.exit('$TORCH' == 'cpu' and torch.version.cuda \
         and 'TORCH=cpu installed a CUDA build of torch: give the CPU wheel')"
WORKDIR /src
# the dependencies alone, from pyproject.toml: no source is copied into this stage, so its
# layers (and the runtime's copy of the venv) stay cached while pipefb's code changes
COPY pyproject.toml ./
RUN --mount=type=bind,from=wheels,target=/wheels --mount=type=secret,id=ca,required=false \
    python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))\
['project']['dependencies']))" > /tmp/requirements.txt \
    && PIP_CERT="$(test -f /run/secrets/ca && echo /run/secrets/ca)" \
       pip install -r /tmp/requirements.txt
# what no role runs: torch's C++ tests and headers (pipefb builds no C++ extension) and its
# test binaries (torch_shm_manager stays)
RUN cd /opt/venv/lib/python*/site-packages \
    && rm -rf torch/test torch/include \
    && find torch/bin -type f ! -name torch_shm_manager -delete \
    && python -c "import torch; torch.ones(2).sum()"

FROM deps AS build
# pipefb's own packages and its `pipefb` command into /opt/pipefb, apart from the venv
COPY README.md ./
COPY pipefb pipefb
COPY protos protos
COPY coordinator coordinator
COPY worker worker
COPY offload_store offload_store
COPY dataplane dataplane
COPY calibration calibration
COPY --from=protos /src/protos/*_pb2.py /src/protos/*_pb2_grpc.py protos/
RUN --mount=type=bind,from=wheels,target=/wheels --mount=type=secret,id=ca,required=false \
    PIP_CERT="$(test -f /run/secrets/ca && echo /run/secrets/ca)" \
    pip install --no-deps --target /opt/pipefb . \
    && cd / && PYTHONPATH=/opt/pipefb python -c "import coordinator.service, worker.service, pipefb.app.cli"

FROM python:${PYTHON}-slim-bookworm AS runtime
RUN groupadd --gid 10001 pipefb \
    && useradd --uid 10001 --gid 10001 --home-dir /tmp --no-create-home \
       --shell /usr/sbin/nologin pipefb
COPY --from=deps /opt/venv /opt/venv
COPY --from=build /opt/pipefb /opt/pipefb
# HOME is /tmp: the pods mount an emptyDir there under a read-only root filesystem
ENV PATH=/opt/pipefb/bin:/opt/venv/bin:$PATH PYTHONPATH=/opt/pipefb \
    PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/tmp
WORKDIR /tmp
USER 10001:10001
# gRPC (coordinator and workers), the workers' heartbeats (coordinator), Prometheus metrics,
# the all-reduce rendezvous (coordinator)
EXPOSE 50051 50052 9090 29500
CMD ["python", "-m", "coordinator"]
