#!/usr/bin/env bash
# The long soak: sets the machine up (scripts/setup.sh) and runs the gRPC
# soak (tests/grpc/run_soak.sh) for as long as asked: one echo server and one
# client with grpc-rdma preloaded over softverbs, mixed calls of every shape
# from 1 byte to 8 MiB on channels that come and go, the client cancelling
# calls and giving some deadlines too short, the server killed and
# restarted or stopped and continued every ~30 s until the last tenth of
# the run, every byte checked; then nothing may be left held (connections,
# pinned memory, descriptors, threads, heap in use) and a new client must
# ride RDMA.
# CI runs short versions (grpc.soak.*); docs/reliability.md has figures.
#
# Usage: scripts/soak.sh [--minutes N] [run_soak.sh options]
#   --minutes N   how long (default 60)
#   e.g. scripts/soak.sh --minutes 180 --netns, scripts/soak.sh --faults kill
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
build=${GRPC_RDMA_BUILD_DIR:-$repo/build}
minutes=60
args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --minutes) minutes=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) args+=("$1"); shift ;;
  esac
done
[[ $minutes =~ ^[0-9]+$ && $minutes -ge 1 ]] ||
  { echo "soak.sh: --minutes takes a whole number of minutes, at least 1, not '$minutes'" >&2; exit 2; }
GRPC_RDMA_BUILD_DIR="$build" "$repo/scripts/setup.sh"
seconds=$(( minutes * 60 ))
exec "$repo/tests/grpc/run_soak.sh" --build "$build" --seconds "$seconds" \
  --quiet $(( seconds / 10 )) --fault-every 30 "${args[@]}"
