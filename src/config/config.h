// File: src/config/config.h
//
// The one place that reads TF_RDMA_* variables. Every variable, its default,
// unit and allowed values are in kVariables (config.cc) and docs/usage.md.
// Bad values are rejected with a message that names the variable, the value
// and what is allowed; nothing falls back silently.
#ifndef GRPC_RDMA_SRC_CONFIG_CONFIG_H_
#define GRPC_RDMA_SRC_CONFIG_CONFIG_H_

#include <functional>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "grpc_rdma/options.h"

namespace grpc_rdma {

// Looks a variable up: its value, or nullopt when it is not set.
using EnvLookup = std::function<std::optional<std::string>(const char* name)>;

// The process environment (getenv).
EnvLookup ProcessEnvironment();

// Parses every TF_RDMA_* variable over the defaults of Options. Errors are
// InvalidArgument; when several variables are bad, all are named.
absl::StatusOr<Options> ParseOptions(const EnvLookup& lookup);

// ParseOptions(ProcessEnvironment()).
absl::StatusOr<Options> OptionsFromEnvironment();

// Checks the ranges and the relations between fields (ACC_SIZE <=
// CHUNK_SIZE, the pool holds one connection's chunks in flight and eager
// buffers, ...), for Options an application filled in. The relations are
// checked on EngineOptions(o), what the engine will run with, so Options
// that pass here also pass the engine's own check (ValidateEngineOptions):
// a setting is refused here, with the variable named, or it works.
absl::Status ValidateOptions(const Options& o);

// TF_RDMA_ACC_SIZE is about message payloads: a gRPC message of ACC_SIZE
// bytes must go eagerly. On the stream it comes with gRPC's and HTTP/2's
// framing (a 5-byte message prefix, 9-byte frame headers, and the call's
// HEADERS frame when chttp2 writes them together), so the engine's eager
// limit is ACC_SIZE plus this room (at most CHUNK_SIZE).
constexpr uint64_t kFramingRoom = 1024;
// The largest eager limit an engine runs with or accepts from a peer: the
// largest TF_RDMA_ACC_SIZE plus the framing room.
constexpr uint64_t kMaxEngineAccSize = (uint64_t{1} << 20) + kFramingRoom;

// The options the engine runs with for a process configured with `o`
// (acc_size with the framing room). The one place that room is added.
Options EngineOptions(const Options& o);

// The engine's own check (Engine::Create): ranges and relations of options
// that already carry the framing room. Everything ValidateOptions accepts
// passes it after EngineOptions.
absl::Status ValidateEngineOptions(const Options& e);

// What one connection needs registered to make progress, for options with
// the framing room: its chunks in flight and both eager rings. The least
// TF_RDMA_BUF_SIZE (and the least locked memory) the engine works with.
uint64_t OneConnectionBytes(const Options& e);

// "4 MiB", "1 GiB", "8 KiB", "1000 B": sizes in messages and logs.
std::string FormatBytes(uint64_t bytes);

// One line per field, for logs ("chunk_size=4 MiB acc_size=8 KiB ...").
std::string DescribeOptions(const Options& o);

}  // namespace grpc_rdma

#endif  // GRPC_RDMA_SRC_CONFIG_CONFIG_H_
