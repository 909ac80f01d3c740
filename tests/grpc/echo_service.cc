#include "echo_service.h"

#include <dlfcn.h>
#include <malloc.h>
#include <unistd.h>

#include <cstdio>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <thread>

namespace grpc_rdma_test {

using grpc_rdma::test::Blob;

namespace {
// Waits `ms`, returning early (false) when the call is cancelled.
bool Wait(grpc::ServerContext* ctx, uint32_t ms) {
  auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  while (std::chrono::steady_clock::now() < end) {
    if (ctx->IsCancelled()) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}
}  // namespace

grpc::Status EchoService::Unary(grpc::ServerContext* ctx, const Blob* in, Blob* out) {
  if (in->delay_ms() > 0 && !Wait(ctx, in->delay_ms()))
    return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled while waiting");
  out->set_data(in->data());
  out->set_peer(ctx->peer());
  return grpc::Status::OK;
}

grpc::Status EchoService::Upload(grpc::ServerContext*, grpc::ServerReader<Blob>* reader,
                                 Blob* out) {
  Blob b;
  std::string all;
  while (reader->Read(&b)) all += b.data();
  out->set_data(std::move(all));
  return grpc::Status::OK;
}

grpc::Status EchoService::Download(grpc::ServerContext* ctx, const Blob* in,
                                   grpc::ServerWriter<Blob>* writer) {
  Blob b;
  b.set_data(in->data());
  for (uint32_t i = 0; i < in->repeat(); ++i) {
    if (in->delay_ms() > 0 && !Wait(ctx, in->delay_ms()))
      return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled while waiting");
    if (!writer->Write(b)) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "write failed");
    if (in->server_cancel()) {
      ctx->TryCancel();
      return grpc::Status(grpc::StatusCode::CANCELLED, "the server cancelled");
    }
  }
  return grpc::Status::OK;
}

grpc::Status EchoService::Chat(grpc::ServerContext*,
                               grpc::ServerReaderWriter<Blob, Blob>* stream) {
  Blob b;
  while (stream->Read(&b)) {
    if (!stream->Write(b)) break;
  }
  return grpc::Status::OK;
}

grpc::Status EchoService::Sink(grpc::ServerContext*, grpc::ServerReader<Blob>* reader,
                               Blob* out) {
  Blob b;
  uint32_t n = 0;
  while (reader->Read(&b)) ++n;
  out->set_repeat(n);
  return grpc::Status::OK;
}

std::unique_ptr<grpc::Server> StartEchoServer(const std::string& addr, int* port,
                                              grpc::Service* service,
                                              std::shared_ptr<grpc::ServerCredentials> creds,
                                              int max_idle_ms) {
  grpc::ServerBuilder b;
  b.AddListeningPort(addr, creds, port);
  b.RegisterService(service);
  b.SetMaxReceiveMessageSize(-1);
  b.SetMaxSendMessageSize(-1);
  if (max_idle_ms > 0) b.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, max_idle_ms);
  return b.BuildAndStart();
}

namespace {
// Writes "<heap in use, bytes> <how many times written>" to `path` every
// second until `stop` (whole files only: a reader never sees half a line;
// the count tells a reader a figure taken after a given moment).
void WriteHeapInUse(const std::string& path, std::atomic<bool>* stop) {
  const std::string tmp = path + ".tmp";
  for (uint64_t n = 1; !stop->load(); ++n) {
    struct mallinfo2 m = mallinfo2();
    if (FILE* f = fopen(tmp.c_str(), "w")) {
      fprintf(f, "%zu %llu\n", m.uordblks + m.hblkhd, static_cast<unsigned long long>(n));
      fclose(f);
      rename(tmp.c_str(), path.c_str());
    }
    for (int i = 0; i < 10 && !stop->load(); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}
}  // namespace

int ServeUntilStdinCloses(const std::string& addr, std::shared_ptr<grpc::ServerCredentials> creds,
                          const ServeOptions& options) {
  EchoService service;
  int port = 0;
  auto server = StartEchoServer(addr, &port, &service, std::move(creds), options.max_idle_ms);
  if (server == nullptr || port == 0) {
    fprintf(stderr, "cannot serve on %s\n", addr.c_str());
    return 1;
  }
  printf("port %d\n", port);
  fflush(stdout);
  std::atomic<bool> stop{false};
  std::thread heap;
  if (!options.heap_file.empty()) heap = std::thread(WriteHeapInUse, options.heap_file, &stop);
  char buf[256];
  while (read(0, buf, sizeof(buf)) > 0) {
  }
  stop = true;
  if (heap.joinable()) heap.join();
  // What the plugin still holds, for a case that failed (a connection
  // gRPC neither served nor closed says here how often it read and wrote).
  // A client that exited just before is given half a second to be seen
  // gone: its connection is still closing, which is no news.
  std::string open = ConnectionsText();
  for (int i = 0; i < 10 && !open.empty(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    open = ConnectionsText();
  }
  if (!open.empty()) fprintf(stderr, "serve: open when told to stop:\n%s", open.c_str());
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(options.grace_s));
  return 0;
}

grpc::ChannelArguments BigMessageArgs() {
  grpc::ChannelArguments a;
  a.SetMaxReceiveMessageSize(-1);
  a.SetMaxSendMessageSize(-1);
  // A channel of its own each time: no subchannel shared with another test.
  a.SetInt("grpc_rdma_test.unique", rand());
  return a;
}

std::string Pattern(size_t n, uint32_t seed) {
  std::string s(n, '\0');
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; ++i) {
    x = x * 1103515245u + 12345u;
    s[i] = static_cast<char>(x >> 24);
  }
  return s;
}

std::string ConnectionsText() {
  using Fn = char* (*)();
  auto fn = reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, "grpc_rdma_connections_text"));
  if (fn == nullptr) return "";
  char* t = fn();
  std::string s = t != nullptr ? t : "";
  free(t);
  return s;
}

std::map<std::string, int64_t> RdmaStats() {
  std::map<std::string, int64_t> out;
  using Fn = char* (*)();
  auto fn = reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, "grpc_rdma_stats_json"));
  if (fn == nullptr) return out;
  char* j = fn();
  if (j == nullptr) return out;
  // {"name":123,...,"devices":{...},"version":"..."}: the top level's
  // numbers only (per-device objects repeat the stream counters' names).
  std::string s(j);
  free(j);
  int depth = 0;
  std::string key;
  for (size_t i = 0; i < s.size(); ++i) {
    char ch = s[i];
    if (ch == '"') {
      std::string text;
      for (++i; i < s.size() && s[i] != '"'; ++i) {
        if (s[i] == '\\') ++i;
        if (i < s.size()) text += s[i];
      }
      if (i + 1 < s.size() && s[i + 1] == ':') key = text;
    } else if (ch == '{') {
      ++depth;
    } else if (ch == '}') {
      --depth;
    } else if (depth == 1 && !key.empty() &&
               (isdigit(static_cast<unsigned char>(ch)) || ch == '-')) {
      char* end = nullptr;
      out[key] = std::strtoll(s.c_str() + i, &end, 10);
      i = static_cast<size_t>(end - s.c_str()) - 1;
      key.clear();
    } else if (ch == ',') {
      key.clear();
    }
  }
  return out;
}

}  // namespace grpc_rdma_test
