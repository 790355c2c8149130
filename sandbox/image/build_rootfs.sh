#!/usr/bin/env bash
# Build the docker sandbox image without any registry (for hosts that cannot pull images; the
# docker backend is described in docs/code-rewards.md):
# debootstrap a minimal Debian bookworm with the toolchain into a temp dir and `docker import` it.
#
#   sudo sandbox/image/build_rootfs.sh [--force]
#
# Idempotent: does nothing when the image already exists (--force rebuilds it). Needs root, a
# running engine (sandbox/image/start_dockerd.sh) and the Debian mirror apt already uses.
# Env: SANDBOX_IMAGE (default rlpost-sandbox:bookworm), DEBIAN_MIRROR (default: the first
# Debian mirror in /etc/apt/sources.list*, else http://deb.debian.org/debian).
# With a registry, `docker build -t rlpost-sandbox:bookworm sandbox/image` gives the same image.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/install_missing.sh"

IMAGE="${SANDBOX_IMAGE:-rlpost-sandbox:bookworm}"
SUITE=bookworm
# gcc/g++/libc6-dev: build C/C++ jobs; python3: Python jobs; valgrind (+ libc6-dbg, which it
# recommends for its ld.so redirections): instruction-count benchmarks; procps: ps/pgrep/pkill.
# coreutils and util-linux (prlimit) are in minbase already.
PACKAGES=gcc,g++,libc6-dev,python3,valgrind,libc6-dbg,procps
SANDBOX_UID=10001   # the container's own (non-root) user; jobs run under per-box uids

FORCE=0
[ "${1:-}" = "--force" ] && FORCE=1

if [ "$FORCE" = 0 ] && docker image inspect "$IMAGE" >/dev/null 2>&1; then
    echo "build_rootfs: image $IMAGE already exists"
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "build_rootfs: debootstrap needs root" >&2
    exit 1
fi
if ! docker info >/dev/null 2>&1; then
    echo "build_rootfs: no Docker engine answers; run sandbox/image/start_dockerd.sh first" >&2
    exit 1
fi

install_missing debootstrap debootstrap build_rootfs

find_mirror() {
    # deb822 (URIs: ...) or one-line (deb URL SUITE ...) sources; skip security/updates repos.
    local f line
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
        [ -r "$f" ] || continue
        while read -r line; do
            case "$line" in
                URIs:*debian-security*|deb\ *debian-security*) ;;
                URIs:*/debian|URIs:*/debian/) echo "${line#URIs:}" | awk '{print $1}'; return ;;
                deb\ http*/debian\ *|deb\ http*/debian/\ *) echo "$line" | awk '{print $2}'; return ;;
            esac
        done <"$f"
    done
    echo http://deb.debian.org/debian
}
MIRROR="${DEBIAN_MIRROR:-$(find_mirror)}"

ROOT="$(mktemp -d /var/tmp/rlpost-rootfs.XXXXXX)"
trap 'rm -rf --one-file-system "$ROOT"' EXIT
echo "build_rootfs: debootstrap $SUITE ($PACKAGES) from $MIRROR into $ROOT"
start=$(date +%s)
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOT" "$MIRROR" \
    >"$ROOT.log" 2>&1 || { tail -n 40 "$ROOT.log" >&2; rm -f "$ROOT.log"; exit 1; }
rm -f "$ROOT.log"

# The non-root user the container itself runs as (it only owns the sleeping init process and
# the supervisor binary the backend compiles into /tmp).
chroot "$ROOT" groupadd -g "$SANDBOX_UID" sandbox
chroot "$ROOT" useradd -u "$SANDBOX_UID" -g "$SANDBOX_UID" -M -d /tmp -s /usr/sbin/nologin sandbox
# Trim what a sandbox never needs.
rm -rf "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/lib/apt/lists/* \
       "$ROOT"/usr/share/doc/* "$ROOT"/usr/share/man/* "$ROOT"/usr/share/info/* \
       "$ROOT"/usr/share/locale/* "$ROOT"/var/log/*.log "$ROOT"/var/cache/debconf/*-old

echo "build_rootfs: importing as $IMAGE"
tar --numeric-owner -C "$ROOT" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change "USER $SANDBOX_UID:$SANDBOX_UID" \
    --change 'WORKDIR /tmp' \
    --change 'CMD ["sleep", "infinity"]' \
    - "$IMAGE" >/dev/null
echo "build_rootfs: built $IMAGE in $(( $(date +%s) - start ))s ($(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}'))"
