// File: tests/grpc/echo_service.h
//
// The Echo service (proto/echo.proto) for the gRPC tests and benchmarks,
// and helpers to read grpc-rdma's stats from a program that was compiled
// without any reference to the library (it is linked or preloaded).
// Public grpc++ API only.
#ifndef GRPC_RDMA_TESTS_GRPC_ECHO_SERVICE_H_
#define GRPC_RDMA_TESTS_GRPC_ECHO_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "echo.grpc.pb.h"

namespace grpc_rdma_test {

class EchoService final : public grpc_rdma::test::Echo::Service {
 public:
  grpc::Status Unary(grpc::ServerContext* ctx, const grpc_rdma::test::Blob* in,
                     grpc_rdma::test::Blob* out) override;
  grpc::Status Upload(grpc::ServerContext* ctx,
                      grpc::ServerReader<grpc_rdma::test::Blob>* reader,
                      grpc_rdma::test::Blob* out) override;
  grpc::Status Download(grpc::ServerContext* ctx, const grpc_rdma::test::Blob* in,
                        grpc::ServerWriter<grpc_rdma::test::Blob>* writer) override;
  grpc::Status Chat(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<grpc_rdma::test::Blob, grpc_rdma::test::Blob>* stream) override;
  grpc::Status Sink(grpc::ServerContext* ctx, grpc::ServerReader<grpc_rdma::test::Blob>* reader,
                    grpc_rdma::test::Blob* out) override;
};

// A server with EchoService on `addr` ("127.0.0.1:0"); *port gets the port.
// `max_idle_ms` > 0: GRPC_ARG_MAX_CONNECTION_IDLE_MS, the server closes a
// connection that had no call for that long.
std::unique_ptr<grpc::Server> StartEchoServer(const std::string& addr, int* port,
                                              grpc::Service* service,
                                              std::shared_ptr<grpc::ServerCredentials> creds =
                                                  grpc::InsecureServerCredentials(),
                                              int max_idle_ms = 0);

struct ServeOptions {
  int grace_s = 2;      // shutdown's grace
  int max_idle_ms = 0;  // see StartEchoServer
  // Non-empty: the heap in use (malloc's, all arenas, mallinfo2), in bytes,
  // and a count of writes, written to this file every second, for a driver
  // that tells a leak from memory malloc keeps.
  std::string heap_file;
};

// Serves EchoService on `addr` for a test driver in another process: prints
// "port N" on stdout, serves until stdin closes, then shuts down. Returns
// the exit code (1: cannot listen).
int ServeUntilStdinCloses(const std::string& addr, std::shared_ptr<grpc::ServerCredentials> creds,
                          const ServeOptions& options);

// Channel arguments that let the largest test messages through.
grpc::ChannelArguments BigMessageArgs();

// `n` bytes that depend on `seed` and the position.
std::string Pattern(size_t n, uint32_t seed);

// grpc-rdma's counters (grpc_rdma::StatsJson), found at run time; empty
// when the library is not in the process.
std::map<std::string, int64_t> RdmaStats();

// grpc_rdma_connections_text() (the RDMA connections the plugin holds,
// docs/usage.md), found at run time; empty when the library is not in the
// process or holds none.
std::string ConnectionsText();

}  // namespace grpc_rdma_test

#endif  // GRPC_RDMA_TESTS_GRPC_ECHO_SERVICE_H_
