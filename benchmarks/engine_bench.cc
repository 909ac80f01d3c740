// engine_bench: the transport engine alone (no gRPC), two processes on one
// host over softverbs. Prints a markdown table:
//   small-message round trip (64 B write, 64 B echoed back), p50 / p99;
//   message rate: 64 B writes with many in flight, to a sink;
//   large-message bandwidth: 256 MiB in 4 MiB writes, for several
//     TF_RDMA_CHUNK_SIZE values;
//   idle CPU: what an idle connection costs each process, per poll mode.
#include <arpa/inet.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "config/config.h"
#include "engine/engine.h"
#include "engine/testing.h"

using namespace grpc_rdma;
using grpc_rdma::testing::Loopback;
using Clock = std::chrono::steady_clock;

namespace {


[[noreturn]] void Die(const std::string& what) {
  fprintf(stderr, "engine_bench: %s\n", what.c_str());
  exit(1);
}

// Server side, in a child: echo (mode 'e') or sink (mode 's') every byte.
void Serve(Options o, int ready_fd, char mode) {
  auto e = Engine::Create(o);
  if (!e.ok()) Die(std::string(e.status().message()));
  std::vector<std::shared_ptr<Connection>> conns;
  std::mutex mu;
  auto port = (*e)->Listen(Loopback(0), [&](std::shared_ptr<Connection> c) {
    std::lock_guard<std::mutex> l(mu);
    conns.push_back(c);
    struct Loop {
      static void Go(std::shared_ptr<Connection> c, char mode) {
        c->Read([c, mode](absl::StatusOr<RecvChunks> r) {
          if (!r.ok()) return;
          if (mode == 'e') {
            auto keep = std::make_shared<std::string>();
            for (auto& ch : *r) keep->append(ch.data(), ch.size());
            iovec v{keep->data(), keep->size()};
            c->Write({v}, [keep](absl::Status) {});
          }
          Go(c, mode);
        });
      }
    };
    Loop::Go(c, mode);
  });
  if (!port.ok()) Die(std::string(port.status().message()));
  uint16_t p = *port;
  (void)!write(ready_fd, &p, sizeof(p));
  pause();  // until killed
}

struct Child {
  pid_t pid = -1;
  uint16_t port = 0;
};

// A fresh process (this binary, --serve): a fork of a process that already
// runs RDMA threads would inherit none of them.
Child StartServer(const Options& o, char mode, uint16_t connect_to = 0) {
  int fds[2];
  if (pipe(fds) != 0) Die("pipe");
  char self[4096];
  ssize_t len = readlink("/proc/self/exe", self, sizeof(self) - 1);
  self[len > 0 ? len : 0] = 0;
  std::string m(1, mode), chunk = std::to_string(o.chunk_size),
      poll = o.poll_mode == PollMode::kEvent ? "event" : o.poll_mode == PollMode::kBusy ? "busy"
                                                                                     : "adaptive",
      fd = std::to_string(fds[1]), target = std::to_string(connect_to);
  pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    if (connect_to != 0)
      execl(self, self, "--idle-client", target.c_str(), chunk.c_str(), poll.c_str(), fd.c_str(),
            nullptr);
    else
      execl(self, self, "--serve", m.c_str(), chunk.c_str(), poll.c_str(), fd.c_str(), nullptr);
    _exit(127);
  }
  close(fds[1]);
  Child c;
  c.pid = pid;
  if (read(fds[0], &c.port, sizeof(c.port)) != sizeof(c.port)) Die("server did not start");
  close(fds[0]);
  return c;
}

void StopServer(Child& c) {
  kill(c.pid, SIGKILL);
  waitpid(c.pid, nullptr, 0);
}

std::shared_ptr<Connection> ConnectTo(Engine& e, uint16_t port) {
  std::promise<absl::StatusOr<std::shared_ptr<Connection>>> p;
  e.Connect(Loopback(port), 5000, [&](auto r) { p.set_value(std::move(r)); });
  auto r = p.get_future().get();
  if (!r.ok()) Die(std::string(r.status().message()));
  return *r;
}

// Reads until `n` bytes arrived.
void ReadBytes(Connection& c, size_t n) {
  std::promise<void> done;
  std::atomic<size_t> got{0};
  std::function<void()> next = [&] {
    c.Read([&](absl::StatusOr<RecvChunks> r) {
      if (!r.ok()) Die("read failed: " + std::string(r.status().message()));
      for (auto& ch : *r) got += ch.size();
      if (got >= n) done.set_value();
      else next();
    });
  };
  next();
  done.get_future().wait();
}

void WriteSync(Connection& c, char* data, size_t n) {
  std::promise<void> done;
  iovec v{data, n};
  c.Write({v}, [&](absl::Status s) {
    if (!s.ok()) Die("write failed");
    done.set_value();
  });
  done.get_future().wait();
}

double Pct(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * v.size()))];
}

double ChildCpuSeconds(pid_t pid) {
  char path[64];
  snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  FILE* f = fopen(path, "r");
  if (!f) return 0;
  char buf[1024];
  size_t n = fread(buf, 1, sizeof(buf) - 1, f);
  fclose(f);
  buf[n] = 0;
  const char* p = strrchr(buf, ')');
  unsigned long ut = 0, st = 0;
  // fields after ')': state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime
  if (p) sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &ut, &st);
  return static_cast<double>(ut + st) / sysconf(_SC_CLK_TCK);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 6 && std::string(argv[1]) == "--idle-client") {
    auto o = OptionsFromEnvironment();
    if (!o.ok()) Die(std::string(o.status().message()));
    std::string poll = argv[4];
    o->poll_mode = poll == "event" ? PollMode::kEvent : PollMode::kAdaptive;
    auto e = Engine::Create(*o);
    if (!e.ok()) Die(std::string(e.status().message()));
    auto c = ConnectTo(**e, static_cast<uint16_t>(atoi(argv[2])));
    uint16_t ok = 1;
    (void)!write(atoi(argv[5]), &ok, sizeof(ok));
    pause();
    return 0;
  }
  if (argc == 6 && std::string(argv[1]) == "--serve") {
    auto o = OptionsFromEnvironment();
    if (!o.ok()) Die(std::string(o.status().message()));
    o->chunk_size = std::strtoull(argv[3], nullptr, 10);
    std::string poll = argv[4];
    o->poll_mode = poll == "event" ? PollMode::kEvent : poll == "busy" ? PollMode::kBusy
                                                                       : PollMode::kAdaptive;
    Serve(*o, atoi(argv[5]), argv[2][0]);
    return 0;
  }
  int iters = 20000;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--iters" && i + 1 < argc) iters = atoi(argv[++i]);
    else Die("usage: engine_bench [--iters N]");
  }
  auto env = OptionsFromEnvironment();
  if (!env.ok()) Die(std::string(env.status().message()));
  Options base = *env;
  printf("| measure (engine only, two processes, softverbs) | value |\n|---|---:|\n");

  // Round trip and message rate.
  {
    fprintf(stderr, "engine_bench: round trips (%d)...\n", iters);
    Child srv = StartServer(base, 'e');
    auto e = Engine::Create(base);
    if (!e.ok()) Die(std::string(e.status().message()));
    auto c = ConnectTo(**e, srv.port);
    std::string msg(64, 'x');
    std::vector<double> us;
    for (int i = 0; i < iters + iters / 10; ++i) {
      auto t0 = Clock::now();
      WriteSync(*c, msg.data(), msg.size());
      ReadBytes(*c, msg.size());
      if (i >= iters / 10)
        us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
    printf("| 64 B round trip p50 (us) | %.1f |\n| 64 B round trip p99 (us) | %.1f |\n",
           Pct(us, 0.5), Pct(us, 0.99));
    StopServer(srv);
  }
  {
    fprintf(stderr, "engine_bench: message rate...\n");
    Child srv = StartServer(base, 's');
    auto e = Engine::Create(base);
    auto c = ConnectTo(**e, srv.port);
    std::string msg(64, 'y');
    constexpr int kWindow = 256;
    const int n = iters * 10;
    std::atomic<int> outstanding{0};
    std::promise<void> all;
    std::atomic<int> done{0};
    auto t0 = Clock::now();
    for (int i = 0; i < n; ++i) {
      while (outstanding.load() >= kWindow) std::this_thread::yield();
      ++outstanding;
      iovec v{msg.data(), msg.size()};
      c->Write({v}, [&](absl::Status) {
        --outstanding;
        if (++done == n) all.set_value();
      });
    }
    all.get_future().wait();
    double s = std::chrono::duration<double>(Clock::now() - t0).count();
    auto st = c->stats();
    printf("| 64 B message rate (Mmsg/s, %d in flight) | %.2f |\n", kWindow, n / s / 1e6);
    printf("| 64 B writes per SEND (coalescing) | %.1f |\n",
           st.eager_messages ? static_cast<double>(n) / st.eager_messages : 0.0);
    StopServer(srv);
  }
  // Bandwidth per chunk size.
  for (uint64_t chunk : {256ull << 10, 1ull << 20, 4ull << 20}) {
    fprintf(stderr, "engine_bench: bandwidth, chunk %s...\n", FormatBytes(chunk).c_str());
    Options o = base;
    o.chunk_size = chunk;
    Child srv = StartServer(o, 's');
    auto e = Engine::Create(o);
    auto c = ConnectTo(**e, srv.port);
    std::string block(4 << 20, 'z');
    const int n = 64;
    std::atomic<int> outstanding{0}, done{0};
    std::promise<void> all;
    auto t0 = Clock::now();
    for (int i = 0; i < n; ++i) {
      while (outstanding.load() >= 4) std::this_thread::yield();
      ++outstanding;
      iovec v{block.data(), block.size()};
      c->Write({v}, [&](absl::Status) {
        --outstanding;
        if (++done == n) all.set_value();
      });
    }
    all.get_future().wait();
    double s = std::chrono::duration<double>(Clock::now() - t0).count();
    printf("| 4 MiB writes, chunk %s (GB/s, 256 MiB) | %.2f |\n", FormatBytes(chunk).c_str(),
           static_cast<double>(n) * block.size() / s / 1e9);
    StopServer(srv);
  }
  // Idle CPU: two fresh processes, one idle connection between them.
  for (PollMode m : {PollMode::kAdaptive, PollMode::kEvent}) {
    Options o = base;
    o.poll_mode = m;
    Child srv = StartServer(o, 'e');
    Child cli = StartServer(o, static_cast<char>('0' + (srv.port % 10)), srv.port);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    double c0 = ChildCpuSeconds(cli.pid), s0 = ChildCpuSeconds(srv.pid);
    std::this_thread::sleep_for(std::chrono::seconds(3));
    double c = (ChildCpuSeconds(cli.pid) - c0) / 3 * 100, sv = (ChildCpuSeconds(srv.pid) - s0) / 3 * 100;
    printf("| idle connection, %s polling: CPU %% of a core (client / server) | %.2f / %.2f |\n",
           m == PollMode::kAdaptive ? "adaptive" : "event", c, sv);
    StopServer(cli);
    StopServer(srv);
  }
  return 0;
}
