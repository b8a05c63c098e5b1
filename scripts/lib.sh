# shellcheck shell=bash
# Helpers shared by tine's host scripts. Source it; do not run it.
#
#   . "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
#
# Layout of the data directory (the Rust code reads only `current/`):
#
#   $TINE_DATA_DIR/kernel/<package>_<version>/{vmlinuz,config,release,lib/modules/<release>/}
#   $TINE_DATA_DIR/rootfs/base-<recipehash>.{ext4,tar}
#   $TINE_DATA_DIR/initramfs/<hash>.cpio
#   $TINE_DATA_DIR/current/{vmlinuz,kernel-modules,kernel-release,rootfs-base.ext4,initramfs.cpio}

TINE_DATA_DIR="${TINE_DATA_DIR:-/var/lib/tine}"
TINE_SCRIPTS_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export TINE_DATA_DIR TINE_SCRIPTS_DIR

# The guest binaries (static, musl), in a target dir of their own so that
# they build while the host's build holds target/ (scripts/build-agent.sh,
# scripts/build-mcp-gateway.sh).
TINE_GUEST_TARGET_DIR="target/guest/x86_64-unknown-linux-musl/release"
TINE_AGENT_BUILT="$TINE_GUEST_TARGET_DIR/tine-agent"

# Debian release the host and the guest rootfs are built for.
TINE_DEBIAN_SUITE="${TINE_DEBIAN_SUITE:-bookworm}"

# ---- logging: everything goes to stderr, stdout stays free for results ----

log() { printf '==> %s\n' "$*" >&2; }
info() { printf '    %s\n' "$*" >&2; }
warn() { printf 'warning: %s\n' "$*" >&2; }
die() {
    printf 'error: %s\n' "$*" >&2
    exit 1
}

need_root() {
    if [[ ${EUID:-$(id -u)} -ne 0 ]]; then
        die "$(basename "$0") must run as root (it installs packages and writes ${TINE_DATA_DIR})"
    fi
}

need_cmd() {
    local c
    for c in "$@"; do
        command -v "$c" >/dev/null 2>&1 || die "required command '$c' not found (run scripts/setup-host.sh)"
    done
}

# Seconds since the epoch with fractions, for timing messages.
now() { date +%s.%N; }
# elapsed START -> "12.3s"
elapsed() { awk -v s="$1" -v e="$(now)" 'BEGIN { printf "%.1fs", e - s }'; }
# disk_report: free space where tine's build and data live, and what the
# biggest of them hold, so a run that fills the disk says what filled it.
disk_report() {
    local dirs=() d
    for d in target "$TINE_DATA_DIR" /dev/shm; do
        [[ -d "$d" ]] && dirs+=("$d")
    done
    info "disk: $(df -h --output=avail,used,size . | tail -1 | awk '{print $1 " free, " $2 " used of " $3}')"
    # (du counts a file once per call: the totals and the biggest parts apart.)
    du -sh "${dirs[@]}" 2>/dev/null | sed 's/^/      /' >&2 || true
    # shellcheck disable=SC2046
    du -sh $(find "${dirs[@]}" -mindepth 1 -maxdepth 1 -type d 2>/dev/null) 2>/dev/null \
        | sort -h | tail -5 | sed 's/^/      /' >&2 || true
}

# recipe_hash FILE... [-- STRING...]
# sha256 over the contents of the given files and then the given strings
# (each tagged and length-delimited so that no two inputs collide); prints the
# first 16 hex characters.
recipe_hash() {
    local seen_sep=0 arg
    {
        for arg in "$@"; do
            if [[ $seen_sep -eq 0 && $arg == -- ]]; then
                seen_sep=1
                continue
            fi
            if [[ $seen_sep -eq 0 ]]; then
                [[ -f $arg ]] || die "recipe_hash: no such file: $arg"
                printf 'file %s\n' "$(sha256sum <"$arg" | cut -c1-64)"
            else
                printf 'str %d %s\n' "${#arg}" "$arg"
            fi
        done
    } | sha256sum | cut -c1-16
}

# Mirror URI the host's apt uses for the main Debian archive (not -security);
# falls back to deb.debian.org.
debian_mirror() {
    local uri=""
    if [[ -f /etc/apt/sources.list.d/debian.sources ]]; then
        # deb822: first stanza whose Suites contain the plain suite name.
        uri="$(awk -v suite="$TINE_DEBIAN_SUITE" '
            BEGIN { RS = ""; FS = "\n" }
            {
                u = ""; ok = 0
                for (i = 1; i <= NF; i++) {
                    if ($i ~ /^URIs:/) { u = $i; sub(/^URIs:[ \t]*/, "", u); sub(/[ \t].*/, "", u) }
                    if ($i ~ /^Suites:/) { n = split($i, s, /[ \t]+/); for (j = 2; j <= n; j++) if (s[j] == suite) ok = 1 }
                }
                if (ok && u != "") { print u; exit }
            }' /etc/apt/sources.list.d/debian.sources)"
    fi
    if [[ -z $uri && -f /etc/apt/sources.list ]]; then
        uri="$(awk -v suite="$TINE_DEBIAN_SUITE" '$1 == "deb" && $3 == suite { print $2; exit }' /etc/apt/sources.list)"
    fi
    printf '%s\n' "${uri:-http://deb.debian.org/debian}"
}

# The security archive's URI, derived from the main mirror the way Debian lays
# them out (…/debian -> …/debian-security).
debian_security_mirror() {
    local uri=""
    if [[ -f /etc/apt/sources.list.d/debian.sources ]]; then
        uri="$(awk -v suite="$TINE_DEBIAN_SUITE-security" '
            BEGIN { RS = ""; FS = "\n" }
            {
                u = ""; ok = 0
                for (i = 1; i <= NF; i++) {
                    if ($i ~ /^URIs:/) { u = $i; sub(/^URIs:[ \t]*/, "", u); sub(/[ \t].*/, "", u) }
                    if ($i ~ /^Suites:/) { n = split($i, s, /[ \t]+/); for (j = 2; j <= n; j++) if (s[j] == suite) ok = 1 }
                }
                if (ok && u != "") { print u; exit }
            }' /etc/apt/sources.list.d/debian.sources)"
    fi
    printf '%s\n' "${uri:-$(debian_mirror)-security}"
}

# Run `apt-get update` at most once per setup run (shared with child scripts
# through the environment).
apt_update_once() {
    if [[ ${TINE_APT_UPDATED:-0} != 1 ]]; then
        log "apt-get update"
        DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2 || die "apt-get update failed"
        TINE_APT_UPDATED=1
        export TINE_APT_UPDATED
    fi
}

# take_lock NAME: serialize builds of one kind across concurrent invocations.
# The lock is held until the calling script exits.
take_lock() {
    mkdir -p "$TINE_DATA_DIR"
    local lock="$TINE_DATA_DIR/.lock-$1"
    exec {TINE_LOCK_FD}>"$lock"
    if ! flock -n "$TINE_LOCK_FD"; then
        info "waiting for another $1 build to finish ($lock)"
        flock "$TINE_LOCK_FD"
    fi
}

# set_current NAME TARGET: point $TINE_DATA_DIR/current/NAME at TARGET,
# atomically (a reader sees the old or the new link, never none).
set_current() {
    local name=$1 target=$2 dir="$TINE_DATA_DIR/current"
    mkdir -p "$dir"
    if [[ -L $dir/$name && $(readlink "$dir/$name") == "$target" ]]; then
        return 0
    fi
    ln -sfn "$target" "$dir/.$name.tmp.$$"
    mv -T "$dir/.$name.tmp.$$" "$dir/$name"
    info "current/$name -> $target"
}

# set_current_file NAME CONTENT: write $TINE_DATA_DIR/current/NAME as a
# regular file, atomically.
set_current_file() {
    local name=$1 content=$2 dir="$TINE_DATA_DIR/current"
    mkdir -p "$dir"
    if [[ -f $dir/$name && ! -L $dir/$name && $(<"$dir/$name") == "$content" ]]; then
        return 0
    fi
    printf '%s\n' "$content" >"$dir/.$name.tmp.$$"
    mv -T "$dir/.$name.tmp.$$" "$dir/$name"
    info "current/$name = $content"
}
