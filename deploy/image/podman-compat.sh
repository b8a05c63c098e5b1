# shellcheck shell=bash
# Flags podman needs to start a container on this host, for
# deploy/image/build.sh (its smoke run) and tests/deploy/podman-node.sh.
# Source it; do not run it. It sets two arrays:
#
#   PODMAN_GLOBAL  flags before the subcommand (podman "${PODMAN_GLOBAL[@]}" run ...)
#   PODMAN_LIMITS  flags for `podman run`
#
# Both stay empty on an ordinary host. They are filled where:
#
# - the cgroup layout is hybrid (v1 hierarchies plus a v2 mount at
#   /sys/fs/cgroup/unified) and the v2 mount has a controller available:
#   crun (podman's default runtime on Debian 12) refuses to start any
#   container there ("cgroups in hybrid mode not supported, drop all
#   controllers from cgroupv2"), whatever --cgroups says; runc starts them.
#   So: --runtime runc (Debian's runc package).
# - this shell has no CAP_SYS_RESOURCE (a host that is itself a sandbox):
#   podman asks for RLIMIT_NOFILE 1048576 by default and sets its own
#   RLIMIT_NPROC to 32768 (seen with strace on podman 4.3), and the
#   runtime cannot raise a limit above what it inherited ("setrlimit
#   RLIMIT_NOFILE: Operation not permitted"). So: the hard limits we have,
#   explicitly, nproc at most 32768.

PODMAN_GLOBAL=()
PODMAN_LIMITS=()

podman_compat() {
    PODMAN_GLOBAL=()
    PODMAN_LIMITS=()
    # (cgroupfs files report size 0: read them.)
    local ctl=/sys/fs/cgroup/unified/cgroup.controllers
    if [[ ! -f /sys/fs/cgroup/cgroup.controllers && -f $ctl && -n $(tr -d ' \n' <"$ctl") ]]; then
        command -v runc >/dev/null 2>&1 ||
            { echo "error: hybrid cgroups with controllers in v2 ($(cat "$ctl")): crun cannot run containers here; install runc" >&2; return 1; }
        PODMAN_GLOBAL+=(--runtime runc)
    fi
    local eff
    eff="$(awk '/^CapEff:/ { print $2 }' /proc/self/status)"
    # CAP_SYS_RESOURCE is capability 24.
    if (( ((0x$eff >> 24) & 1) == 0 )); then
        local nofile nproc
        nofile="$(ulimit -Hn)"
        nproc="$(ulimit -Hu)"
        [[ $nofile == unlimited ]] && nofile=1048576
        if [[ $nproc == unlimited || $nproc -gt 32768 ]]; then nproc=32768; fi
        PODMAN_LIMITS+=(--ulimit "nofile=$nofile:$nofile" --ulimit "nproc=$nproc:$nproc")
    fi
}
