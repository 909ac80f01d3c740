// A gRPC server's first moves over the RDMA engine, slowed down: it
// accepts RDMA connections, reads the client's HTTP/2 preface, answers
// with an empty SETTINGS frame only after --settings-ms, and closes the
// connection --close-ms after that. For E2eTest's check of gRPC 1.51's
// transport leak (a subchannel shut down while its connection waited for
// SETTINGS): the window is made wide on purpose.
//
// usage: slow_settings_server [--settings-ms N] [--close-ms N]
// Prints "port P" once it listens on 127.0.0.1; exits when stdin closes.
#include <arpa/inet.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/engine.h"

namespace {

using grpc_rdma::Connection;

int settings_ms = 1000, close_ms = 1000;

std::mutex mu;
std::vector<std::thread> workers;

// Reads until the 24-byte client preface is in (or the connection ends).
bool ReadPreface(const std::shared_ptr<Connection>& c) {
  size_t got = 0;
  while (got < 24) {
    auto done = std::make_shared<std::promise<size_t>>();
    std::future<size_t> f = done->get_future();
    c->Read([done](absl::StatusOr<grpc_rdma::RecvChunks> r) {
      size_t n = 0;
      if (r.ok()) {
        for (const auto& ch : *r) n += ch.size();
      }
      done->set_value(r.ok() ? n : 0);
    });
    size_t n = f.get();
    if (n == 0) return false;
    got += n;
  }
  return true;
}

void Serve(std::shared_ptr<Connection> c) {
  if (!ReadPreface(c)) return;
  std::this_thread::sleep_for(std::chrono::milliseconds(settings_ms));
  static char settings[9] = {0, 0, 0, 4, 0, 0, 0, 0, 0};  // SETTINGS, empty, stream 0
  std::promise<absl::Status> written;
  c->Write({iovec{settings, sizeof(settings)}}, [&](absl::Status s) { written.set_value(s); });
  absl::Status s = written.get_future().get();
  fprintf(stderr, "slow_settings_server: SETTINGS %s\n", s.ok() ? "sent" : "not sent");
  std::this_thread::sleep_for(std::chrono::milliseconds(close_ms));
  c->Shutdown(absl::UnavailableError("slow_settings_server closes it"));
  fprintf(stderr, "slow_settings_server: closed\n");
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i + 1 < argc; i += 2) {
    if (strcmp(argv[i], "--settings-ms") == 0) {
      settings_ms = atoi(argv[i + 1]);
    } else if (strcmp(argv[i], "--close-ms") == 0) {
      close_ms = atoi(argv[i + 1]);
    } else {
      fprintf(stderr, "slow_settings_server: unknown option %s\n", argv[i]);
      return 2;
    }
  }
  auto engine = grpc_rdma::Engine::Create(grpc_rdma::Options());
  if (!engine.ok()) {
    fprintf(stderr, "slow_settings_server: no RDMA engine: %s\n",
            std::string(engine.status().message()).c_str());
    return 1;
  }
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  auto port = (*engine)->Listen(addr, [](std::shared_ptr<Connection> c) {
    std::lock_guard<std::mutex> g(mu);
    workers.emplace_back(Serve, std::move(c));
  });
  if (!port.ok()) {
    fprintf(stderr, "slow_settings_server: cannot listen: %s\n",
            std::string(port.status().message()).c_str());
    return 1;
  }
  printf("port %u\n", static_cast<unsigned>(*port));
  fflush(stdout);
  char buf[64];
  while (read(0, buf, sizeof(buf)) > 0) {
  }
  // Joined without the lock: an accept meanwhile (on the engine's poller)
  // takes it.
  std::vector<std::thread> done;
  {
    std::lock_guard<std::mutex> g(mu);
    done.swap(workers);
  }
  for (std::thread& t : done) t.join();
  return 0;
}
