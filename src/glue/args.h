// File: src/glue/args.h
//
// gRPC-native controls: channel and server arguments (GRPC_RDMA_ARG_* in
// grpc_rdma/grpc_rdma.h) that override the TF_RDMA_* environment for one
// channel or one server. A bad value is logged (once per key and value)
// and the environment's setting used.
#ifndef GRPC_RDMA_SRC_GLUE_ARGS_H_
#define GRPC_RDMA_SRC_GLUE_ARGS_H_

#include <grpc/event_engine/endpoint_config.h>

#include <vector>

#include "grpc_rdma/options.h"

namespace grpc_rdma {

struct ArgSettings {
  bool enabled = true;          // false: TCP only, as if RDMA were not there
  Fallback fallback = Fallback::kTcp;
  int connect_timeout_ms = 1000;
  bool tcp_first = false;  // start on TCP, move to RDMA (TF_RDMA_TCP_FIRST)
  std::vector<int> tcp_only_ports;  // a server's listening ports that serve TCP only
};

ArgSettings SettingsFor(const grpc_event_engine::experimental::EndpointConfig& config,
                        const Options& env);

}  // namespace grpc_rdma

#endif  // GRPC_RDMA_SRC_GLUE_ARGS_H_
