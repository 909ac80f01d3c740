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

// Checks the relations between fields (ACC_SIZE <= CHUNK_SIZE, the pool
// holds the chunks in flight, ...), for Options an application filled in.
absl::Status ValidateOptions(const Options& o);

// "4 MiB", "1 GiB", "8 KiB", "1000 B": sizes in messages and logs.
std::string FormatBytes(uint64_t bytes);

// One line per field, for logs ("chunk_size=4 MiB acc_size=8 KiB ...").
std::string DescribeOptions(const Options& o);

}  // namespace grpc_rdma

#endif  // GRPC_RDMA_SRC_CONFIG_CONFIG_H_
