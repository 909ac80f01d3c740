#!/usr/bin/env bash
# README's main job: sets the machine up (scripts/setup.sh) and runs the
# point-to-point benchmark, printing a table.
#
# Until the gRPC benchmark lands it runs softverbs' own benchmark (a
# small-message round trip over softverbs beside a TCP loopback ping-pong,
# and 4 MB RDMA WRITE bandwidth beside memcpy) and then the transport
# engine's (round trip, message rate, bandwidth per chunk size, idle CPU),
# two processes on one host each. docs/performance.md explains the figures.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
GRPC_RDMA_BUILD_DIR="${GRPC_RDMA_BUILD_DIR:-$repo/build}" "$repo/scripts/setup.sh"
build=${GRPC_RDMA_BUILD_DIR:-$repo/build}
echo "bench: softverbs point-to-point (device mlx5_0 on 127.0.0.1)"
export SOFTVERBS_DEVICES="${SOFTVERBS_DEVICES:-mlx5_0:127.0.0.1}"
"$build/benchmarks/softverbs_bench" "$@"
echo
echo "bench: the transport engine alone (no gRPC) over softverbs"
"$build/benchmarks/engine_bench"
