# Sourced by start_dockerd.sh and build_rootfs.sh (not run on its own).

# install_missing CMD PACKAGE WHO: when CMD is not on PATH, install Debian's PACKAGE (without its
# recommends) from apt, saying so as WHO. Quiet first; if that fails, once more with apt's output,
# so that the error shows.
install_missing() {
    local cmd="$1" package="$2" who="$3"
    command -v "$cmd" >/dev/null 2>&1 && return 0
    echo "$who: installing $package from apt"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "$package" >/dev/null 2>&1 \
        || apt-get install -y --no-install-recommends "$package"
}
