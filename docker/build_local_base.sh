#!/usr/bin/env bash
# A local stand-in for python:3.11-slim-bookworm, made from Debian packages where no image registry can be reached
# (CI, air-gapped sites), and imported into podman (or docker):
#
#   sudo docker/build_local_base.sh [TAG]     # prints the tag; then:
#   podman build --build-arg BASE=<that tag> -f docker/Dockerfile.cpu -t megaopd:cpu .
#
# debootstrap's minbase bookworm from the Debian mirror apt already uses (MEGAOPD_DEBIAN_MIRROR to name another),
# plus bookworm's python3 (3.11, the images' Python) with a venv at /opt/venv first on PATH: `pip install` then
# works as in the python image (bookworm's own pip refuses to install into the system Python, PEP 668).
# The default tag carries a hash of this script and the mirror, so a tag that exists was made by this very
# recipe: it is reused (about 2 min saved) unless MEGAOPD_REBUILD_BASE=1. ENGINE=docker imports it into docker.
set -euo pipefail

ENGINE=${ENGINE:-podman}
mirror_apt_uses() {
  sed -n -e 's/^URIs: *\([^ ]*\).*/\1/p' -e 's/^deb  *\(\[[^]]*\] *\)\{0,1\}\([^ ]*\).*/\2/p' \
    /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null | grep -v security | head -n1 || true
}
MIRROR=${MEGAOPD_DEBIAN_MIRROR:-$(mirror_apt_uses)}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
recipe=$( { cat "$0"; echo "$MIRROR"; } | sha256sum | cut -c1-12)
TAG=${1:-localhost/megaopd-base:bookworm-$recipe}

if [ "${MEGAOPD_REBUILD_BASE:-}" != 1 ] && "$ENGINE" image inspect "$TAG" >/dev/null 2>&1; then
  echo "$TAG"
  exit 0
fi
for tool in debootstrap "$ENGINE"; do
  command -v "$tool" >/dev/null || { echo "build_local_base.sh: needs $tool (apt-get install debootstrap podman runc)" >&2; exit 1; }
done

rootfs=$(mktemp -d /var/tmp/megaopd-base.XXXXXX)
cleanup() {
  umount "$rootfs/proc" "$rootfs/dev" 2>/dev/null || true
  rm -rf "$rootfs"
}
trap cleanup EXIT
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" "$MIRROR" >&2
mount --bind /dev "$rootfs/dev"
mount -t proc proc "$rootfs/proc"
chroot "$rootfs" python3 -m venv /opt/venv
umount "$rootfs/proc" "$rootfs/dev"
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*

tar -C "$rootfs" -c . | "$ENGINE" import \
  --change "ENV VIRTUAL_ENV=/opt/venv" \
  --change "ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
  --change "ENV LANG=C.UTF-8" \
  --change 'CMD ["python3"]' - "$TAG" >&2
echo "$TAG"
