#!/usr/bin/env bash
# P1 from an image template vs from base (issue 11: "as fast as base, within
# 1.1x"): 10 cold creates of each, alternating, no warm pool, through the
# Python SDK, on a data dir of its own (/var/lib/tine/p1img). The image is the
# base rootfs tar as one layer in docker-registry on loopback, converted here
# (its chunks local, read through the image daemon). Needs a release build and
# tests/e2e/setup.sh (the venv with e2b, docker-registry).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BIN="${TINE_BIN:-$HERE/../../target/release/tine}"
D=/var/lib/tine/p1img
pkill -f "qemu-system.*$D/" || true
rm -rf $D /tmp/tine-p1-image-registry; mkdir -p $D /tmp/tine-p1-image-registry
ln -s /var/lib/tine/current $D/current
PORT=5099
cat > /tmp/tine-p1-image-registry/config.yml <<C
version: 0.1
log: {level: error}
storage: {filesystem: {rootdirectory: /tmp/tine-p1-image-registry/data}}
http: {addr: '127.0.0.1:$PORT'}
C
/usr/bin/docker-registry serve /tmp/tine-p1-image-registry/config.yml >/dev/null 2>&1 &
REG=$!
sleep 1
/var/lib/tine/venv/bin/python "$HERE/push.py" 127.0.0.1:$PORT
export TINE_DATA_DIR=$D TINE_SHM_DIR=/dev/shm/tine-p1img
$BIN image pull 127.0.0.1:$PORT/bench/debian:v1
$BIN template build img --from-image 127.0.0.1:$PORT/bench/debian:v1 --vcpus 1 --memory-mib 256
printf 'default_cpu_count = 1\ndefault_memory_mb = 256\npool_size = 0\n' > $D/config.toml
KEY=$($BIN keys create --name p1img)
$BIN serve --listen 127.0.0.1:3997 -c $D/config.toml > $D/server.log 2>&1 &
SRV=$!
sleep 3
E2B_API_URL=http://127.0.0.1:3997 E2B_SANDBOX_URL=http://127.0.0.1:3997 E2B_API_KEY=$KEY /var/lib/tine/venv/bin/python "$HERE/measure.py"
kill $SRV; wait $SRV || true
kill $REG || true
pkill -f "qemu-system.*$D/" || true
