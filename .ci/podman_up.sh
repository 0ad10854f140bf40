#!/usr/bin/env bash
# Install what tests/test_docker_images.py builds and runs images with (Debian packages; needs root):
#
#   sudo .ci/podman_up.sh      # idempotent: podman 4.3 (runs containers with runc: crun refuses cgroups in
#                              # hybrid mode), debootstrap (docker/build_local_base.sh) and runc
set -euo pipefail

if ! command -v podman >/dev/null || ! command -v debootstrap >/dev/null || ! command -v runc >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends podman debootstrap runc >/dev/null
fi
podman --version
