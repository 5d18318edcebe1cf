#!/usr/bin/env bash
# Installs Debian's prometheus package (prometheus and promtool) unless both are on PATH.
# Idempotent and quiet; tests/test_metrics.py scrapes a local run with it. Without root or
# apt-get it only says so: that test then skips with a message.
set -euo pipefail
if command -v prometheus >/dev/null && command -v promtool >/dev/null; then
  exit 0
fi
if ! command -v apt-get >/dev/null; then
  echo "install_prometheus: no apt-get; tests/test_metrics.py will skip" >&2
  exit 0
fi
sudo=""
if [ "$(id -u)" != 0 ]; then
  if ! command -v sudo >/dev/null; then
    echo "install_prometheus: not root and no sudo; tests/test_metrics.py will skip" >&2
    exit 0
  fi
  sudo="sudo -n"
fi
export DEBIAN_FRONTEND=noninteractive
install() {
  $sudo apt-get install -y -qq --no-install-recommends prometheus >/dev/null
}
# the package lists may be missing or stale on a fresh machine: update once and retry
install 2>/dev/null || { $sudo apt-get update -qq >/dev/null && install; }
