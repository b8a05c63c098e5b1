#!/usr/bin/env bash
# build-initramfs.sh AGENT_BINARY
#
# Pack the guest initramfs: an uncompressed newc cpio (uncompressed boots
# faster under TCG), owned by root, containing
#
#   /init                 the agent binary (static; mode 0755)
#   /lib/modules/NAME.ko  the kernel modules the guest needs, flat
#   /modules.order        their paths, one a line, dependencies first:
#                         the agent loads them in this order
#   /kernel-release       the `uname -r` the modules belong to
#   /dev/console /dev /proc /sys /newroot
#
# Modules come from the kernel published as current/ by build-kernel.sh;
# dependencies are resolved from modules.dep (plus "pre:" soft dependencies),
# and modules the kernel has built in are skipped. The result is cached as
# $TINE_DATA_DIR/initramfs/<hash>.cpio, the hash covering the agent binary,
# the module list, the kernel and this script; it is published as
# current/initramfs.cpio.
#
# Environment: TINE_DATA_DIR (default /var/lib/tine),
#              TINE_INITRAMFS_MODULES (space-separated, overrides the list).
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

# Block device, network, console, vsock, entropy and the balloon (free page
# reporting: the guest hands freed memory back) over virtio-mmio, and the
# root filesystem, and the NFS v3 client for volumes (crate::volumes::nfs
# on the host). Their dependencies are added automatically.
DEFAULT_MODULES="virtio_mmio virtio_blk virtio_net virtio_console vmw_vsock_virtio_transport virtio_rng virtio_balloon ext4 nfsv3"
MODULES="${TINE_INITRAMFS_MODULES:-$DEFAULT_MODULES}"

[[ $# -eq 1 ]] || die "usage: $(basename "$0") AGENT_BINARY"
agent="$1"
[[ -f $agent ]] || die "agent binary not found: $agent"

need_root # device node in the archive, files owned by root
need_cmd cpio sha256sum file

desc="$(file -bL "$agent")"
[[ $desc == ELF* ]] || die "$agent is not an ELF executable ($desc)"
if [[ $desc == *"dynamically linked"* ]]; then
    die "$agent is dynamically linked; /init must be static (build with --target x86_64-unknown-linux-musl)"
fi

# ---- the kernel whose modules we pack ----
vmlinuz="$(readlink -f "$TINE_DATA_DIR/current/vmlinuz" 2>/dev/null || true)"
[[ -n $vmlinuz && -f $vmlinuz ]] || die "no kernel at $TINE_DATA_DIR/current/vmlinuz (run scripts/build-kernel.sh)"
kdir="$(dirname "$vmlinuz")"
kernel_key="$(basename "$kdir")"
release="$(<"$kdir/release")"
mdir="$kdir/lib/modules/$release"
[[ -f $mdir/modules.dep ]] || die "no modules.dep in $mdir"

# ---- resolve modules: deps first, built-ins skipped ----
modname() {
    local b=${1##*/}
    b=${b%.ko}
    printf '%s' "${b//-/_}"
}

declare -A MPATH=() MDEPS=() BUILTIN=() SOFTPRE=() ALIAS=() STATE=()
while IFS= read -r line; do
    path=${line%%:*}
    b=${path##*/}
    b=${b%.ko}
    b=${b//-/_}
    MPATH[$b]=$path
    MDEPS[$b]=${line#*:}
done <"$mdir/modules.dep"
if [[ -f $mdir/modules.builtin ]]; then
    while IFS= read -r path; do
        b=${path##*/}
        b=${b%.ko}
        BUILTIN[${b//-/_}]=1
    done <"$mdir/modules.builtin"
fi
if [[ -f $mdir/modules.softdep ]]; then
    # "softdep MOD pre: a b post: c"
    while read -r kw mod rest; do
        [[ $kw == softdep ]] || continue
        pre=""
        mode=""
        for w in $rest; do
            case $w in
            pre:) mode=pre ;;
            post:) mode=post ;;
            *) if [[ $mode == pre ]]; then pre+=" $w"; fi ;;
            esac
        done
        [[ -n $pre ]] && SOFTPRE[${mod//-/_}]+="$pre"
    done <"$mdir/modules.softdep"
fi
if [[ -f $mdir/modules.alias ]]; then
    # Exact (non-wildcard) aliases only: enough for "crypto-crc32c" & co.
    while read -r kw alias mod; do
        [[ $kw == alias && $alias != *'*'* ]] || continue
        ALIAS[$alias]+=" ${mod//-/_}"
    done <"$mdir/modules.alias"
fi

ORDER=()
SKIPPED=()

# visit NAME HARD: post-order walk, so every module follows its dependencies.
visit() {
    local n=${1//-/_} hard=$2 d s cand
    case ${STATE[$n]:-} in
    visited) return 0 ;;
    active) die "module dependency cycle at $n" ;;
    esac
    if [[ -n ${BUILTIN[$n]:-} ]]; then
        STATE[$n]=visited
        SKIPPED+=("$n")
        return 0
    fi
    if [[ -z ${MPATH[$n]:-} ]]; then
        # A soft dependency may name an alias ("crc32c", "crypto-crc32c").
        cand=""
        for s in $n crypto-$n; do
            [[ -n ${ALIAS[$s]:-} ]] && cand=${ALIAS[$s]} && break
        done
        if [[ -n $cand ]]; then
            # Prefer the generic implementation: it loads on any CPU.
            for s in $cand; do
                if [[ $s == *_generic ]]; then
                    visit "$s" "$hard"
                    return 0
                fi
            done
            read -r s _ <<<"$cand"
            visit "$s" "$hard"
            return 0
        fi
        if [[ $hard == 1 ]]; then
            die "kernel $release has no module '$n' (neither in modules.dep nor built in)"
        fi
        warn "soft dependency '$n' not found; skipped"
        STATE[$n]=visited
        return 0
    fi
    STATE[$n]=active
    for s in ${SOFTPRE[$n]:-}; do visit "$s" 0; done
    for d in ${MDEPS[$n]}; do visit "$(modname "$d")" 1; done
    STATE[$n]=visited
    ORDER+=("$n")
}

for m in $MODULES; do visit "$m" 1; done

order_list="${ORDER[*]}"
hash="$(recipe_hash "$agent" "${BASH_SOURCE[0]}" -- "kernel=$kernel_key" "modules=$MODULES" "order=$order_list")"
out_dir="$TINE_DATA_DIR/initramfs"
out="$out_dir/$hash.cpio"

take_lock initramfs

if [[ -f $out ]]; then
    log "initramfs $hash: present"
    set_current initramfs.cpio "$out"
    exit 0
fi

start=$(now)
log "building initramfs (recipe $hash) for kernel $release"
info "modules (load order): ${order_list:-none}"
[[ ${#SKIPPED[@]} -eq 0 ]] || info "built into the kernel, skipped: ${SKIPPED[*]}"

mkdir -p "$out_dir"
work="$(mktemp -d "$out_dir/.tmp-$hash.XXXXXX")"
trap 'rm -rf "$work"' EXIT
root="$work/root"
mkdir -p "$root"/{dev,proc,sys,newroot,lib/modules}
chmod 0755 "$root" "$root"/{dev,proc,sys,newroot,lib,lib/modules}
# The kernel opens /dev/console for PID 1's stdio before /init runs.
mknod -m 0600 "$root/dev/console" c 5 1
install -m 0755 "$agent" "$root/init"
: >"$root/modules.order"
for n in "${ORDER[@]}"; do
    install -m 0644 "$mdir/${MPATH[$n]}" "$root/lib/modules/$n.ko"
    printf '/lib/modules/%s.ko\n' "$n" >>"$root/modules.order"
done
chmod 0644 "$root/modules.order"
printf '%s\n' "$release" >"$root/kernel-release"
chmod 0644 "$root/kernel-release"

# Reproducible archive: fixed mtimes, sorted names, renumbered inodes.
find "$root" -exec touch -h -d @0 {} +
(cd "$root" && find . -mindepth 1 | LC_ALL=C sort |
    cpio -o -H newc -R 0:0 --reproducible --quiet) >"$work/out.cpio"
chmod 0644 "$work/out.cpio"
mv -f "$work/out.cpio" "$out"
info "$(du -h --apparent-size "$out" | cut -f1) in $(elapsed "$start"): $out"
set_current initramfs.cpio "$out"
