// File: src/verbs/log.h
//
// Where the library's own messages go. By default to stderr, as
// "grpc_rdma: <message>"; libgrpc_rdma.so sends them through gRPC's logger
// instead (src/glue), so GRPC_VERBOSITY and gpr_set_log_function apply to
// them as to gRPC's own. The layers below the glue know nothing of gRPC:
// they call GRPC_RDMA_LOG_ERROR and the sink decides.
//
//   GRPC_RDMA_LOG_ERROR("connection %s: %s; closing it", peer, why);
#ifndef GRPC_RDMA_SRC_VERBS_LOG_H_
#define GRPC_RDMA_SRC_VERBS_LOG_H_

namespace grpc_rdma {

enum class LogSeverity { kInfo, kError };

// Receives one formatted message (no prefix, no newline) and where it was
// logged. Called on whatever thread logs, possibly with locks held: it
// must not call back into the library.
using LogSink = void (*)(LogSeverity severity, const char* file, int line, const char* message);

// nullptr: back to stderr. Thread-safe.
void SetLogSink(LogSink sink);

void LogAt(LogSeverity severity, const char* file, int line, const char* format, ...)
    __attribute__((format(printf, 4, 5)));

}  // namespace grpc_rdma

#define GRPC_RDMA_LOG_ERROR(...) \
  ::grpc_rdma::LogAt(::grpc_rdma::LogSeverity::kError, __FILE__, __LINE__, __VA_ARGS__)

#endif  // GRPC_RDMA_SRC_VERBS_LOG_H_
