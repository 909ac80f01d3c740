#include "verbs/log.h"

#include <atomic>
#include <cstdarg>
#include <cstdio>

namespace grpc_rdma {
namespace {

std::atomic<LogSink> g_sink{nullptr};

}  // namespace

void SetLogSink(LogSink sink) { g_sink.store(sink); }

void LogAt(LogSeverity severity, const char* file, int line, const char* format, ...) {
  char message[1024];  // longer messages are cut, never dropped
  va_list args;
  va_start(args, format);
  vsnprintf(message, sizeof(message), format, args);
  va_end(args);
  if (LogSink sink = g_sink.load()) {
    sink(severity, file, line, message);
  } else {
    fprintf(stderr, "grpc_rdma: %s\n", message);
  }
}

}  // namespace grpc_rdma
