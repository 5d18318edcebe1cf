#!/usr/bin/env bash
# The container test (deploy/containertest.py): builds the image from the Dockerfile and
# runs it with podman, on the host's loopback and through `podman kube play` of the cpu
# overlay. Installs what it needs from Debian's packages (root); .ci/run calls it after
# the test suite. Storage and build cache: /var/tmp/pipefb-container (kept between runs).
set -euo pipefail
cd "$(dirname "$0")/.."
missing=()
for tool in podman runc debootstrap; do
  command -v "$tool" >/dev/null || missing+=("$tool")
done
if ((${#missing[@]})); then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc debootstrap >/dev/null
fi
exec .venv/bin/python -m deploy.containertest "$@"
