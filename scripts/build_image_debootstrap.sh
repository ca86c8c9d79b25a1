#!/usr/bin/env bash
# Build and smoke-test the tuning image (docker/Dockerfile) on a machine with no Docker engine and no container
# registry: a Debian bookworm base made with debootstrap replaces the CUDA base (through the BASE_IMAGE build
# ARG), buildah builds (chroot isolation, vfs storage), podman runs the result with runc. Needs root and apt.
#
#   PIP_CA=/etc/ssl/certs/ca-certificates.crt scripts/build_image_debootstrap.sh
#
# PIP_CA: a CA bundle for pip behind a TLS-intercepting proxy, given to the build as the secret pip_ca (it is
# not stored in the image). The result differs from the real image only in its base: Debian 12's Python 3.11
# and no CUDA toolkit (no nvcc), so it compiles CUDA modules but cannot load them.
set -euo pipefail
cd "$(dirname "$0")/.."

WORK=${WORK:-/tmp/stof-image}
BASE=localhost/stof-base:bookworm-debootstrap
IMAGE=${IMAGE:-localhost/stof-tvm:tune-debootstrap}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
STORE=(--storage-driver vfs)
# runc, not crun: crun refuses hybrid cgroup v1/v2 hosts. Lower limits: setting the host's own values needs
# CAP_SYS_RESOURCE, which some sandboxes drop.
RUN=(podman "${STORE[@]}" --runtime runc run --rm --ulimit nofile=1024:1024 --ulimit nproc=1000:1000)

for tool in buildah podman runc debootstrap; do
    command -v "$tool" >/dev/null || missing="${missing:-} $tool"
done
if [ -n "${missing:-}" ]; then
    apt-get install -y --no-install-recommends buildah podman runc debootstrap
fi

if ! podman "${STORE[@]}" image exists "$BASE"; then
    mkdir -p "$WORK"
    [ -x "$WORK/rootfs/bin/sh" ] || nice -n 19 debootstrap --variant=minbase bookworm "$WORK/rootfs" "$MIRROR"
    tar -C "$WORK/rootfs" -c . | podman "${STORE[@]}" import - "$BASE"
fi

secret=()
[ -n "${PIP_CA:-}" ] && secret=(--secret "id=pip_ca,src=$PIP_CA")
start=$(date +%s)
nice -n 19 buildah "${STORE[@]}" build --isolation chroot --layers --build-arg "BASE_IMAGE=$BASE" \
    "${secret[@]}" -f docker/Dockerfile -t "$IMAGE" .
echo "built $IMAGE in $(( $(date +%s) - start )) s"

echo "--- smoke test"
"${RUN[@]}" "$IMAGE" id
"${RUN[@]}" "$IMAGE" --help | head -3
"${RUN[@]}" "$IMAGE" masks causal --seq-len 256 | head -3
"${RUN[@]}" "$IMAGE" python3 -c "import tvm, stof_tvm.tuning.rpc; print('tvm', tvm.__version__)"
