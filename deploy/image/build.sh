#!/usr/bin/env bash
# build.sh: the container image of tine, built on this host from Debian's
# packages and the local tine binary, with no registry:
#
#   1. the base, localhost/tine-base:<recipe hash>: a Debian 12 root made
#      by mmdebstrap (variant apt) with what `tine serve` runs on a host:
#      qemu-system-x86 and qemu-utils >= 10 (bookworm-backports, as
#      scripts/setup-host.sh installs them on a host), iproute2 (ip),
#      nftables (nft), e2fsprogs (mkfs.ext4, debugfs), util-linux, procps,
#      ca-certificates (image pulls over https), libsqlite3-0 and libzstd1
#      (tine links them), publicsuffix (the list header transforms check
#      wildcards against); no python3 (tine runs it
#      only in its tests), imported with `podman import`. The hash covers
#      the suite and every mmdebstrap option (packages, hooks), not the
#      mirror. The tarball is kept, keyed by the same hash, in
#      $TINE_DATA_DIR/container-image/ (not images/: that is tine's own
#      OCI store, which prunes what it does not know);
#   2. the image, localhost/tine:<hash of base hash, Containerfile and
#      binary>: the base plus the tine binary at /usr/local/bin/tine,
#      ENTRYPOINT tine (deploy/image/Containerfile, `podman build
#      --pull=never`), also tagged localhost/tine:latest.
#
# Each level is reused when podman has it (a tarball is reused when the
# image is gone); a new image is run once (tine --version, QEMU >= 10 and
# the tools) before it is tagged latest, and older images of this script
# (other tags of the repository) are removed. Installs buildah, mmdebstrap,
# podman and runc where they are missing. Progress goes to stderr; the
# last line on stdout is the image's name. The guest artifacts (kernel, initramfs, base rootfs) are
# not in the image: nodes mount them from the host ($TINE_DATA_DIR/current),
# as deploy/kubernetes/node.yaml does.
#
# Environment: TINE_BIN (default target/release/tine; build it with
# `cargo build --release -p tine-cli`), TINE_DATA_DIR (/var/lib/tine),
# TINE_MIRROR (default: the host apt's Debian mirror),
# TINE_IMAGE_REPO (localhost/tine).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
# shellcheck source=scripts/lib.sh
. "$ROOT/scripts/lib.sh"
# shellcheck source=deploy/image/podman-compat.sh
. "$HERE/podman-compat.sh"

REPO="${TINE_IMAGE_REPO:-localhost/tine}"
BASE_REPO="$REPO-base"
CACHE="$TINE_DATA_DIR/container-image"
SUITE="$TINE_DEBIAN_SUITE"
BACKPORTS="$SUITE-backports"
# What build.sh and tests/deploy/podman-node.sh need on the host (runc
# where crun cannot run containers: podman-compat.sh). Installed with their
# Recommends, as `apt-get install podman` does (its network backend,
# buildah).
TOOLS=(buildah mmdebstrap podman runc)
# The base's packages. Kept sorted; changing either list changes the hash.
PACKAGES=(ca-certificates e2fsprogs iproute2 libsqlite3-0 libzstd1 nftables procps publicsuffix util-linux)
# From bookworm-backports (QEMU >= 10, as on a host).
QEMU_PACKAGES=(qemu-system-x86 qemu-utils)
QEMU_MIN_MAJOR=10

need_root
start=$(now)

# ---- tools ----
missing=()
for p in "${TOOLS[@]}"; do
    dpkg-query -W -f='${db:Status-Abbrev}' "$p" 2>/dev/null | grep -q '^ii' || missing+=("$p")
done
if [[ ${#missing[@]} -gt 0 ]]; then
    apt_update_once
    log "installing ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >&2 ||
        die "apt-get install ${missing[*]} failed"
fi
need_cmd mmdebstrap podman sha256sum

TINE_BIN="${TINE_BIN:-$ROOT/target/release/tine}"
[[ -x $TINE_BIN ]] || die "no tine binary at $TINE_BIN (cargo build --release -p tine-cli, or set TINE_BIN)"

# ---- 1. the base ----
# The mmdebstrap options are the recipe: every one of them is hashed.
# QEMU comes from bookworm-backports the way setup-host.sh installs it on a
# host (apt-get -t: its dependencies from there too where it needs newer
# ones; `--include=pkg/release` cannot, it picks only the named packages
# from backports), inside the chroot: an apt-get of the hook's own with
# mmdebstrap's APT_CONFIG would run dpkg on the host.
include="$(IFS=,; printf '%s' "${PACKAGES[*]}")"
# shellcheck disable=SC2016 # the hooks are expanded by mmdebstrap's shell
MMDEBSTRAP_ARGS=(
    --variant=apt
    --components=main
    --include="$include"
    --aptopt='Acquire::Languages "none"'
    --dpkgopt='path-exclude=/usr/share/man/*'
    --dpkgopt='path-exclude=/usr/share/info/*'
    --dpkgopt='path-exclude=/usr/share/doc/*'
    --dpkgopt='path-include=/usr/share/doc/*/copyright'
    --dpkgopt='path-exclude=/usr/share/locale/*'
    --customize-hook="chroot \"\$1\" env DEBIAN_FRONTEND=noninteractive apt-get install --yes --quiet=2 --no-install-recommends -t $BACKPORTS ${QEMU_PACKAGES[*]}"
    --customize-hook='chroot "$1" qemu-system-x86_64 --version | head -n1'
    --customize-hook=': > "$1/etc/machine-id"'
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin && mkdir -p "$1/var/lib/apt/lists/partial"'
)
base_hash="$(recipe_hash -- "suite=$SUITE" "mmdebstrap ${MMDEBSTRAP_ARGS[*]}")"
base="$BASE_REPO:$base_hash"
tarball="$CACHE/tine-base-$base_hash.tar"

# ensure_base: the base image in podman, from the cached tarball or a new
# mmdebstrap run.
ensure_base() {
    if podman image exists "$base"; then
        log "base image $base: present"
    else
        if [[ -f $tarball ]]; then
            log "base image $base: importing the cached $tarball"
        else
            log "base image $base: mmdebstrap $SUITE (+ ${QEMU_PACKAGES[*]} from $BACKPORTS)"
            mirror="${TINE_MIRROR:-$(debian_mirror)}"
            security="$(debian_security_mirror)"
            [[ -n ${TINE_MIRROR:-} ]] && security="${TINE_MIRROR%/}-security"
            info "from $mirror: ${PACKAGES[*]} ${QEMU_PACKAGES[*]}"
            mkdir -p "$CACHE"
            work="$(mktemp -d "$CACHE/.tmp-base-$base_hash.XXXXXX")"
            trap 'rm -rf "$work"' EXIT
            t=$(now)
            # mmdebstrap stages the tree under TMPDIR: keep it on the data disk.
            TMPDIR="$work" mmdebstrap --quiet "${MMDEBSTRAP_ARGS[@]}" \
                "$SUITE" "$work/base.tar" \
                "deb $mirror $SUITE main" \
                "deb $mirror $SUITE-updates main" \
                "deb $security $SUITE-security main" \
                "deb $mirror $BACKPORTS main" >&2 ||
                die "mmdebstrap failed"
            chmod 0644 "$work/base.tar"
            mv -f "$work/base.tar" "$tarball"
            rm -rf "$work"
            info "tarball $(du -h --apparent-size "$tarball" | cut -f1) in $(elapsed "$t")"
        fi
        podman import --quiet \
            --change 'CMD ["/bin/bash"]' \
            --change "LABEL dev.tine.base-recipe=$base_hash" \
            --message "tine base: mmdebstrap $SUITE, recipe $base_hash" \
            "$tarball" "$base" >/dev/null || die "podman import $tarball failed"
        info "imported as $base"
    fi
}

# ---- 2. the image ----
hash="$(recipe_hash "$HERE/Containerfile" "$TINE_BIN" -- "base=$base_hash")"
image="$REPO:$hash"
take_lock container-image
if podman image exists "$image"; then
    log "image $image (base $base): present"
else
    ensure_base
    log "image $image: $base + $(basename "$TINE_BIN") ($(du -h "$TINE_BIN" | cut -f1))"
    ctx="$(mktemp -d)"
    trap 'rm -rf "$ctx"' EXIT
    install -m 0755 "$TINE_BIN" "$ctx/tine"
    podman build --quiet --pull=never \
        --build-arg "BASE=$base" --build-arg "TINE_BASE_RECIPE=$base_hash" \
        --label "dev.tine.image-recipe=$hash" \
        -f "$HERE/Containerfile" -t "$image" "$ctx" >/dev/null ||
        die "podman build failed"
    rm -rf "$ctx"
    # What a node runs, checked in the image itself (shared libraries,
    # QEMU's version).
    podman_compat
    versions="$(podman "${PODMAN_GLOBAL[@]}" run --rm "${PODMAN_LIMITS[@]}" --network none \
        --entrypoint /bin/sh "$image" -c '
            set -e
            tine --version
            qemu-system-x86_64 --version | head -n1
            qemu-img --version | head -n1
            ip -V
            nft --version
            mkfs.ext4 -V 2>&1 | head -n1
            debugfs -V 2>&1 | head -n1')" ||
        { podman rmi "$image" >/dev/null 2>&1 || true; die "the new image does not run its tools: $versions"; }
    while IFS= read -r l; do info "$l"; done <<<"$versions"
    qemu_major="$(sed -nE 's/^QEMU emulator version ([0-9]+)\..*/\1/p' <<<"$versions")"
    [[ -n $qemu_major && $qemu_major -ge $QEMU_MIN_MAJOR ]] ||
        { podman rmi "$image" >/dev/null 2>&1 || true; die "QEMU in the image is not >= $QEMU_MIN_MAJOR"; }
fi
podman tag "$image" "$REPO:latest"
# Older images of this script (its label, another tag of $REPO): one per
# binary built, so they would pile up. One a container still uses stays.
while read -r old; do
    [[ $old == "$image" || $old == "$REPO:latest" || $old != "$REPO:"* ]] && continue
    podman rmi "$old" >/dev/null 2>&1 && info "removed the older $old"
done < <(podman images --filter label=dev.tine.image-recipe --format '{{.Repository}}:{{.Tag}}')
log "$image (also $REPO:latest), $(podman image inspect -f '{{.Size}}' "$image" | awk '{ printf "%.0f MB", $1 / 1e6 }'), in $(elapsed "$start")"
printf '%s\n' "$image"
