#include "echo_service.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdio>

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
                                              std::shared_ptr<grpc::ServerCredentials> creds) {
  grpc::ServerBuilder b;
  b.AddListeningPort(addr, creds, port);
  b.RegisterService(service);
  b.SetMaxReceiveMessageSize(-1);
  b.SetMaxSendMessageSize(-1);
  return b.BuildAndStart();
}

int ServeUntilStdinCloses(const std::string& addr, std::shared_ptr<grpc::ServerCredentials> creds,
                          int grace_s) {
  EchoService service;
  int port = 0;
  auto server = StartEchoServer(addr, &port, &service, std::move(creds));
  if (server == nullptr || port == 0) {
    fprintf(stderr, "cannot serve on %s\n", addr.c_str());
    return 1;
  }
  printf("port %d\n", port);
  fflush(stdout);
  char buf[256];
  while (read(0, buf, sizeof(buf)) > 0) {
  }
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(grace_s));
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

std::map<std::string, int64_t> RdmaStats() {
  std::map<std::string, int64_t> out;
  using Fn = char* (*)();
  auto fn = reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, "grpc_rdma_stats_json"));
  if (fn == nullptr) return out;
  char* j = fn();
  if (j == nullptr) return out;
  // {"name":123,...,"rdma_unavailable":"..."}: numbers only are kept.
  std::string s(j);
  free(j);
  size_t i = 0;
  while ((i = s.find('"', i)) != std::string::npos) {
    size_t k = s.find('"', i + 1);
    if (k == std::string::npos || k + 1 >= s.size() || s[k + 1] != ':') break;
    std::string key = s.substr(i + 1, k - i - 1);
    size_t v = k + 2;
    if (v < s.size() && (isdigit(static_cast<unsigned char>(s[v])) || s[v] == '-')) {
      out[key] = std::strtoll(s.c_str() + v, nullptr, 10);
    }
    i = s.find_first_of(",}", v);
    if (i == std::string::npos) break;
  }
  return out;
}

}  // namespace grpc_rdma_test
