#!/usr/bin/env bash
# Start a local Docker engine for the docker sandbox backend (docs/code-rewards.md), on a host
# where none runs.
#
#   sudo sandbox/image/start_dockerd.sh
#
# Idempotent: does nothing when `docker info` already works. Installs Debian's docker.io when
# `dockerd` is missing. The engine runs with no iptables and no default bridge (sandbox
# containers use network_mode=none) on overlay2 (vfs costs seconds per container).
# Env: DOCKERD_LOG (default /var/log/rlpost-dockerd.log), DOCKERD_WAIT_S (default 60).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/install_missing.sh"

LOG="${DOCKERD_LOG:-/var/log/rlpost-dockerd.log}"
WAIT_S="${DOCKERD_WAIT_S:-60}"

if docker info >/dev/null 2>&1; then
    echo "start_dockerd: an engine is already running"
    exit 0
fi

if [ "$(id -u)" != 0 ]; then
    echo "start_dockerd: no engine answers and starting one needs root" >&2
    exit 1
fi

# Without recommends: no apparmor/cgroupfs-mount/git etc.; dockerd needs only containerd+runc.
install_missing dockerd docker.io start_dockerd

if ! command -v docker >/dev/null 2>&1; then
    echo "start_dockerd: the docker CLI is missing after installing docker.io" >&2
    exit 1
fi

# dockerd writes its pid here; a stale file from an engine that died keeps a new one from starting.
PIDFILE=/var/run/docker.pid
if [ -f "$PIDFILE" ] && ! kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
    rm -f "$PIDFILE"
fi

if [ ! -f "$PIDFILE" ]; then
    mkdir -p "$(dirname "$LOG")"
    echo "start_dockerd: starting dockerd (log: $LOG)"
    nohup setsid dockerd --iptables=false --ip6tables=false --bridge=none \
        --storage-driver=overlay2 >>"$LOG" 2>&1 </dev/null &
else
    echo "start_dockerd: dockerd (pid $(cat "$PIDFILE")) is starting; waiting for it"
fi

for _ in $(seq 1 "$((WAIT_S * 2))"); do
    if docker info >/dev/null 2>&1; then
        echo "start_dockerd: engine is up"
        exit 0
    fi
    sleep 0.5
done
echo "start_dockerd: dockerd did not answer within ${WAIT_S}s; last lines of $LOG:" >&2
tail -n 30 "$LOG" >&2 || true
exit 1
