#!/usr/bin/env bash
# README's main job: sets the machine up (scripts/setup.sh) and runs the
# gRPC point-to-point benchmark (benchmarks/run_grpc_bench.py): gRPC over
# TCP loopback, over RDMA (softverbs) and in-process, interleaved, with
# progress on stderr; prints the table and writes results.json, results.md
# and PNG plots into build/bench-results. docs/performance.md explains the
# figures.
#
# Usage: scripts/bench.sh [--layers] [run_grpc_bench.py options]
#   --layers   also run the softverbs and engine benchmarks (the layers
#              under gRPC) first
#   e.g. scripts/bench.sh --reps 5, scripts/bench.sh --quick
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
build=${GRPC_RDMA_BUILD_DIR:-$repo/build}
layers=0
args=()
for a in "$@"; do
  case "$a" in
    --layers) layers=1 ;;
    -h|--help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) args+=("$a") ;;
  esac
done
GRPC_RDMA_BUILD_DIR="$build" "$repo/scripts/setup.sh"
export SOFTVERBS_DEVICES="${SOFTVERBS_DEVICES:-mlx5_0:127.0.0.1}"
if [[ $layers == 1 ]]; then
  echo "bench: softverbs point-to-point (device mlx5_0 on 127.0.0.1)"
  "$build/benchmarks/softverbs_bench"
  echo
  echo "bench: the transport engine alone (no gRPC) over softverbs"
  "$build/benchmarks/engine_bench"
  echo
fi
# Debian's python3 has python3-matplotlib (setup.sh installs it) for the
# plots; another python3 first on PATH may not.
py=python3
[[ -x /usr/bin/python3 ]] && py=/usr/bin/python3
echo "bench: gRPC point-to-point, TCP vs RDMA (softverbs) vs in-process"
exec "$py" "$repo/benchmarks/run_grpc_bench.py" --build "$build" "${args[@]}"
