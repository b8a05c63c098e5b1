#!/usr/bin/env bash
# test.sh [PART...]: install what is missing, then run tine's tests.
#
# With no PART, every part runs, in this order:
#
#   unit     Rust tests: unit tests and real QEMU VMs (cargo test --workspace)
#   bench    a smoke run of `tine bench`: every scenario once, tiny counts
#   agent    the guest agent (the musl binary of the initramfs) against the
#            real E2B Python and JS SDKs                tests/e2e/agent/run.sh
#   server   the server against the real E2B SDKs (pinned, older and newest
#            releases, JS, domain mode)                 tests/e2e/server/run.sh
#   cluster  cluster mode (PostgreSQL, 3 nodes, 2 gateways)
#                                                       tests/e2e/cluster/run.sh
#   deploy   deploy/ manifests and units, the container image, and a node in
#            podman behind gateways                     tests/deploy/
#   lint     cargo clippy --workspace --all-targets -D warnings
#
# Before them, what the chosen parts need, each skipped when present:
# host setup (packages, kernel, base rootfs), the guest agent and its
# initramfs, the E2B SDKs of the end-to-end tests, and ONE debug build of
# the workspace (`cargo test --no-run`), whose `tine` every later part
# runs: nothing is built twice.
#
# Every step prints its time; a table of them (and each step's budget)
# ends the run, whether it passed or not. A step over its budget is named
# there (a warning: the budgets keep CI's growth visible, they fail
# nothing). The server suite runs in two shards on two servers side by
# side, the cluster suite before the second shard; their lines are
# prefixed [server], [cluster] and [server-b] (TINE_TEST_SERIAL=1: one
# after the other). Must run as root (network namespaces, tap devices,
# QEMU).
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$TINE_SCRIPTS_DIR/.."

ALL_PARTS=(unit bench agent server cluster deploy lint)
usage() {
    echo "usage: $0 [PART...]   (PART: ${ALL_PARTS[*]}; default: all)" >&2
    exit 2
}
parts=()
for arg in "$@"; do
    case " ${ALL_PARTS[*]} " in
    *" $arg "*) parts+=("$arg") ;;
    *) usage ;;
    esac
done
[[ ${#parts[@]} -gt 0 ]] || parts=("${ALL_PARTS[@]}")
want() {
    local p
    for p in "${parts[@]}"; do [[ $p == "$1" ]] && return 0; done
    return 1
}
need_root

# Seconds each step may take on a 2-core machine without KVM (CI's
# kind): what it took in measured runs, with about a third more room
# (setup-e2e and server include first-time installs and the mcp-gateway
# template build, which a warm data dir skips).
declare -A BUDGET=(
    [setup-host]=240 [build-agent]=180 [setup-e2e]=240 [build]=300
    [unit]=120 [bench]=450 [agent]=60 [server]=1500 [server-b]=900 [cluster]=800
    [deploy]=240 [lint]=180
)
STEPS=()
suite_start=$(now)
# step NAME CMD...: run CMD as one timed step of the table.
step() {
    local name=$1 start rc=0
    shift
    log "[$name] $*"
    start=$(now)
    "$@" || rc=$?
    local secs
    secs=$(awk -v s="$start" -v e="$(now)" 'BEGIN { printf "%d", e - s + 0.5 }')
    STEPS+=("$name $secs $rc")
    # (A step run by `side_by_side` reports to its file too.)
    if [[ -n ${STEP_OUT:-} ]]; then echo "$name $secs $rc" >"$STEP_OUT"; fi
    info "[$name] $([[ $rc -eq 0 ]] && echo passed || echo "FAILED (exit $rc)") in ${secs}s"
    return "$rc"
}
# side_by_side STREAM...: streams at once, each a space-separated list of
# steps (names of PART_CMD) run one after the other; each line of a step's
# output is prefixed with [NAME]. Fails if any step failed. The end-to-end
# suites each keep about one guest busy at a time (one vCPU under TCG: one
# of CI's two cores), so two streams take about the time of the longer.
declare -A PART_CMD=(
    [server]="env TINE_E2E_SHARD=a tests/e2e/server/run.sh"
    [server-b]="env TINE_E2E_SHARD=b tests/e2e/server/run.sh"
    [cluster]="tests/e2e/cluster/run.sh"
)
side_by_side() {
    local dir stream name line rc=0
    dir=$(mktemp -d)
    for stream in "$@"; do
        (
            set +e
            for name in $stream; do
                # (word splitting of the command is meant: no paths with spaces)
                # shellcheck disable=SC2086
                STEP_OUT="$dir/$name" step "$name" ${PART_CMD[$name]} 2>&1 | sed -u "s/^/[$name] /" >&2
            done
        ) &
    done
    wait
    for stream in "$@"; do
        for name in $stream; do
            line=$(cat "$dir/$name" 2>/dev/null) || line="$name 0 1"
            STEPS+=("$line")
            [[ ${line##* } == 0 ]] || rc=1
        done
    done
    rm -rf "$dir"
    return "$rc"
}
table() {
    local line name secs rc budget note total
    total=$(awk -v s="$suite_start" -v e="$(now)" 'BEGIN { printf "%d", e - s + 0.5 }')
    {
        echo
        echo "==> steps of this run (scripts/test.sh ${parts[*]})"
        printf '    %-12s %7s %7s  %s\n' step seconds budget result
        for line in "${STEPS[@]}"; do
            read -r name secs rc <<<"$line"
            budget=${BUDGET[$name]:-}
            note=$([[ $rc -eq 0 ]] && echo ok || echo "FAILED ($rc)")
            if [[ -n $budget && $secs -gt $budget ]]; then note+=", OVER BUDGET"; fi
            printf '    %-12s %7s %7s  %s\n' "$name" "$secs" "${budget:--}" "$note"
        done
        printf '    %-12s %7s\n' total "$total"
    } >&2
}
trap table EXIT

e2e=0
for p in bench agent server cluster deploy; do want "$p" && e2e=1; done
build=0
for p in unit bench server cluster deploy; do want "$p" && build=1; done

if [[ ${parts[*]} == lint ]]; then
    # clippy needs the packages and the toolchain, not the guest.
    step setup-host "$TINE_SCRIPTS_DIR/setup-host.sh" packages
else
    step setup-host "$TINE_SCRIPTS_DIR/setup-host.sh"
    step build-agent "$TINE_SCRIPTS_DIR/build-agent.sh"
fi
if [[ $e2e -eq 1 ]]; then
    step setup-e2e tests/e2e/setup.sh
fi
disk_report

# The one build: test binaries and `tine` (the CLI's integration test needs
# it), with the features every test target unifies to. A later `cargo
# test` in this run compiles nothing.
TINE_BIN="$PWD/target/debug/tine"
# The agent of the initramfs (static, release): what the guests run is
# what the agent suite tests.
TINE_AGENT_BIN="$PWD/$TINE_AGENT_BUILT"
export TINE_BIN TINE_AGENT_BIN
if [[ $build -eq 1 ]]; then
    step build cargo test --workspace --locked --no-run
    [[ -x $TINE_BIN ]] || die "cargo test --no-run made no $TINE_BIN"
fi

if want unit; then
    step unit cargo test --workspace --locked
fi
if want bench; then
    # #[ignore]d in `unit`: it runs here, as its own step with its budget.
    step bench cargo test --workspace --locked --test bench_smoke -- --ignored
fi
if want agent; then
    step agent tests/e2e/agent/run.sh
fi
# The server suite in two shards on two servers, side by side; the
# cluster suite before the second shard (TINE_TEST_SERIAL=1: all one
# after the other, the server suite unsharded).
if [[ ${TINE_TEST_SERIAL:-0} == 1 ]]; then
    PART_CMD[server]="tests/e2e/server/run.sh"
    for p in server cluster; do
        if want "$p"; then
            disk_report
            step "$p" ${PART_CMD[$p]}
        fi
    done
elif want server || want cluster; then
    disk_report
    second=""
    want cluster && second="cluster"
    want server && second+=" server-b"
    if want server; then
        side_by_side server "$second"
    else
        side_by_side cluster
    fi
fi
# (Chained with &&: `set -e` does not hold in a function run by `step`.)
deploy() {
    local start image
    log "deploy/: Kubernetes manifests (kubernetes-validate), systemd units, configs"
    tests/deploy/validate.sh || return
    # build.sh installs podman, runc and mmdebstrap where they are missing.
    start=$(now)
    image="$(deploy/image/build.sh)" || return
    info "$image ready in $(elapsed "$start")"
    log "deploy/: a node in a privileged podman container behind gateways"
    TINE_IMAGE="$image" tests/deploy/podman-node.sh
}
if want deploy; then
    step deploy deploy
fi
if want lint; then
    step lint cargo clippy --workspace --locked --all-targets -- -D warnings
fi
disk_report
log "all tests passed"
