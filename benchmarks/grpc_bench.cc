// grpc_bench: what a gRPC application gets, point to point. Written against
// the public grpc++ API only; the transport is chosen from outside (TCP: as
// is; RDMA: libgrpc_rdma.so preloaded; in-process: --inprocess), so the same
// code measures all three (benchmarks/run_grpc_bench.py drives it).
//
//   grpc_bench serve ADDR              Echo server; prints "port N"; runs
//                                      until stdin closes
//   grpc_bench run (--target T | --inprocess) SUITE [options]
//
// Suites (one JSON object per line on stdout):
//   latency  --sizes 1,64,...   unary ping-pong: p50, p99 (microseconds)
//   stream   --sizes 65536,...  streaming one way, MB/s, in both
//            directions: client to server (a client stream into a sink,
//            "stream" lines) and server to client (a server stream of
//            copies of one message, "download" lines); with the plugin in
//            the process, also host copies per byte sent and received
//            (from its counters)
//   rate     --clients N        N channels, one thread each, 64 B unary
//                               calls: calls per second
//   connect  [--gap-ms G]       a new channel per call, each closed after
//                               its first 64 B unary call: p50, p99 of that
//                               first call, connection set-up included
//                               (what a short-lived client or a new worker
//                               meets; microseconds). Back to back, or G ms
//                               apart: then each meets no work left by the
//                               one before (its teardown, a set-up it
//                               started and never used)
//   ps       --model resnet50|vgg16 --workers W --steps S
//            parameter-server training traffic: each step every worker
//            sends each variable's gradient and gets the parameter back
//            (one unary call per variable, all in flight at once, as
//            tf_cnn_benchmarks' workers do); steps per second
//   --seconds X  time per measure (default 1)
//   --server-pid P  also report the CPU the server process P spent (same
//                host): rate and stream then give CPU time per call or per
//                GB for both processes, the emulated RDMA device's threads
//                (softverbs' agents) apart from the rest
#include <dirent.h>
#include <grpcpp/grpcpp.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "../tests/grpc/echo_service.h"
#include "models.h"

namespace {

using grpc_rdma::test::Blob;
using grpc_rdma::test::Echo;
using Clock = std::chrono::steady_clock;

struct Args {
  std::string target;
  bool inprocess = false;
  std::string suite;
  std::vector<size_t> sizes;
  int clients = 4;
  std::string model = "resnet50";
  int workers = 2;
  int steps = 3;
  double seconds = 1.0;
  int server_pid = 0;
  int gap_ms = 0;  // connect: pause between channels
};

[[noreturn]] void Die(const std::string& why) {
  fprintf(stderr, "grpc_bench: %s\n", why.c_str());
  exit(2);
}

std::vector<size_t> ParseSizes(const std::string& s) {
  std::vector<size_t> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    char* end = nullptr;
    unsigned long long v = strtoull(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0') Die("--sizes: '" + item + "' is not a byte count");
    out.push_back(static_cast<size_t>(v));
  }
  return out;
}

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// CPU time a process has run: all of it from the process's CPU-time clock
// (clock_getcpuclockid: user and system time of every thread, threads that
// ended included, as gRPC's sync server starts and ends threads as load
// changes), and the emulated RDMA device's part: the CPU time of softverbs'
// agent threads from /proc/PID/task/*/schedstat (named "softverbs-agent",
// they live as long as the process), plus the device work softverbs did on
// the application's threads (copies on post, frames moved by polls and
// completion-channel waits), which it keeps in SOFTVERBS_DEVICE_CPU_DIR/PID
// when that is set (the runner sets it). That is the work an HCA would take
// off the host's CPUs.
struct CpuTime {
  double total_s = 0, device_s = 0;
  CpuTime operator-(const CpuTime& o) const { return {total_s - o.total_s, device_s - o.device_s}; }
};

CpuTime CpuOf(int pid) {
  CpuTime t;
  std::string proc = "/proc/" + std::to_string(pid);
  clockid_t clock;
  timespec ts{};
  int err = clock_getcpuclockid(pid, &clock);
  if (err != 0 || clock_gettime(clock, &ts) != 0)
    Die("cannot read the CPU time of process " + std::to_string(pid) + ": " +
        strerror(err != 0 ? err : errno) + " (is it running?)");
  t.total_s = static_cast<double>(ts.tv_sec) + ts.tv_nsec * 1e-9;
  std::string dir = proc + "/task";
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] == '.') continue;
      std::string task = dir + "/" + e->d_name;
      std::ifstream ss(task + "/schedstat"), cs(task + "/comm");
      double ns = 0;
      std::string comm;
      if (!(ss >> ns) || !std::getline(cs, comm)) continue;  // the thread ended meanwhile
      if (comm == "softverbs-agent") t.device_s += ns * 1e-9;
    }
    closedir(d);
  }
  if (const char* dir = getenv("SOFTVERBS_DEVICE_CPU_DIR")) {
    std::ifstream f(std::string(dir) + "/" + std::to_string(pid), std::ios::binary);
    uint64_t ns = 0;
    if (f.read(reinterpret_cast<char*>(&ns), sizeof(ns))) t.device_s += ns * 1e-9;
  }
  return t;
}

// Snapshots of this process and the server (when known).
struct CpuMark {
  CpuTime self, server;
};

CpuMark MarkCpu(const Args& a) {
  CpuMark m;
  m.self = CpuOf(getpid());
  if (a.server_pid > 0) m.server = CpuOf(a.server_pid);
  return m;
}

// ,"cpu":{...}: CPU seconds per `unit` (a call, a GB) between two marks,
// client and server, each with the emulated device's part.
std::string CpuJson(const Args& a, const CpuMark& m0, const CpuMark& m1, double units) {
  if (!(units > 0)) return "";
  CpuTime c = m1.self - m0.self, s = m1.server - m0.server;
  char buf[256];
  snprintf(buf, sizeof(buf),
           ",\"cpu_client_us\":%.2f,\"cpu_client_device_us\":%.2f"
           ",\"cpu_server_us\":%.2f,\"cpu_server_device_us\":%.2f",
           c.total_s * 1e6 / units, c.device_s * 1e6 / units,
           a.server_pid > 0 ? s.total_s * 1e6 / units : 0.0,
           a.server_pid > 0 ? s.device_s * 1e6 / units : 0.0);
  return buf;
}

// ,"copies_per_byte_sent":X,"copies_per_byte_received":Y: host copies of
// stream bytes (grpc-rdma's counters, this process) per stream byte sent and
// received between two snapshots; nothing when the plugin is not in the
// process.
std::string CopiesJson(const std::map<std::string, int64_t>& a,
                       const std::map<std::string, int64_t>& b) {
  auto d = [&](const char* k) {
    auto i = a.find(k), j = b.find(k);
    return (i == a.end() || j == b.end()) ? 0.0 : static_cast<double>(j->second - i->second);
  };
  if (a.empty() || !(d("bytes_sent") > 0) || !(d("bytes_received") > 0)) return "";
  char buf[128];
  snprintf(buf, sizeof(buf), ",\"copies_per_byte_sent\":%.3f,\"copies_per_byte_received\":%.3f",
           d("bytes_copied_on_send") / d("bytes_sent"),
           d("bytes_copied_on_receive") / d("bytes_received"));
  return buf;
}

class Bench {
 public:
  explicit Bench(const Args& a) : a_(a) {
    if (a.inprocess) {
      grpc::ServerBuilder b;
      b.RegisterService(&service_);
      b.SetMaxReceiveMessageSize(-1);
      b.SetMaxSendMessageSize(-1);
      server_ = b.BuildAndStart();
    }
  }

  // A new channel (its own connection) each call.
  std::unique_ptr<Echo::Stub> Stub() {
    grpc::ChannelArguments args = grpc_rdma_test::BigMessageArgs();
    if (a_.inprocess) return Echo::NewStub(server_->InProcessChannel(args));
    return Echo::NewStub(
        grpc::CreateCustomChannel(a_.target, grpc::InsecureChannelCredentials(), args));
  }

  void Latency() {
    auto stub = Stub();
    for (size_t n : a_.sizes) {
      Blob req, resp;
      req.set_data(grpc_rdma_test::Pattern(n, 1));
      auto call = [&] {
        grpc::ClientContext ctx;
        grpc::Status s = stub->Unary(&ctx, req, &resp);
        if (!s.ok()) Die("unary " + std::to_string(n) + " B: " + s.error_message());
      };
      // Warm-up: 20 calls and at least 0.25 s, so that every transport's
      // steady state (pollers, buffer pools, HTTP/2 windows) is reached.
      auto warm = Clock::now() + std::chrono::milliseconds(250);
      for (int i = 0; i < 20 || Clock::now() < warm; ++i) call();
      auto copies0 = grpc_rdma_test::RdmaStats();
      std::vector<double> us;
      auto end = Clock::now() + std::chrono::duration<double>(a_.seconds);
      while ((Clock::now() < end || us.size() < 20) && us.size() < 200000) {
        auto t0 = Clock::now();
        call();
        us.push_back(Seconds(Clock::now() - t0) * 1e6);
      }
      if (resp.data() != req.data()) Die("unary " + std::to_string(n) + " B came back different");
      std::sort(us.begin(), us.end());
      std::string copies = CopiesJson(copies0, grpc_rdma_test::RdmaStats());
      printf("{\"suite\":\"latency\",\"size\":%zu,\"n\":%zu,\"p50_us\":%.2f,\"p99_us\":%.2f%s}\n",
             n, us.size(), us[us.size() / 2], us[std::min(us.size() - 1, us.size() * 99 / 100)],
             copies.c_str());
      fflush(stdout);
    }
  }

  void Stream() {
    auto stub = Stub();
    for (size_t n : a_.sizes) {
      Blob b;
      b.set_data(grpc_rdma_test::Pattern(n, 2));
      double bytes = 0;
      auto once = [&](double secs) {
        grpc::ClientContext ctx;
        Blob resp;
        auto w = stub->Sink(&ctx, &resp);
        uint64_t sent = 0;
        auto t0 = Clock::now();
        auto end = t0 + std::chrono::duration<double>(secs);
        while (Clock::now() < end || sent < 8) {
          if (!w->Write(b)) break;
          ++sent;
        }
        w->WritesDone();
        grpc::Status s = w->Finish();
        double t = Seconds(Clock::now() - t0);
        if (!s.ok()) Die("stream " + std::to_string(n) + " B failed: " + s.error_message());
        if (resp.repeat() != sent)
          Die("stream " + std::to_string(n) + " B: the server counted " +
              std::to_string(resp.repeat()) + " messages of " + std::to_string(sent));
        bytes = static_cast<double>(sent) * n;
        return bytes / t / 1e6;
      };
      // Warm-up on the same channel, as long as the measure (at least
      // 0.5 s): HTTP/2 flow-control windows grow with the bandwidth-delay
      // estimate, and streaming over RDMA took about a second to reach its
      // steady rate here (0.34-0.80 GB/s in 1 s runs, 2.2 GB/s over 3 s).
      once(std::max(0.5, a_.seconds));
      auto copies0 = grpc_rdma_test::RdmaStats();
      CpuMark m0 = MarkCpu(a_);
      double mb_per_s = once(a_.seconds);
      CpuMark m1 = MarkCpu(a_);
      std::string copies = CopiesJson(copies0, grpc_rdma_test::RdmaStats());
      // CPU per GB moved (microseconds per GB: "_us" as for calls).
      printf("{\"suite\":\"stream\",\"size\":%zu,\"mb_per_s\":%.1f%s%s}\n", n, mb_per_s,
             CpuJson(a_, m0, m1, bytes / 1e9).c_str(), copies.c_str());
      fflush(stdout);
      Download(stub.get(), n);
    }
  }

  // Server to client: the server writes `count` copies of one message of
  // n bytes as fast as the stream takes them; the client reads and checks
  // each. The count is set from a short first run so that the measure
  // lasts about --seconds (a stream the client cancelled to stop it would
  // end in an error, not a clean finish).
  void Download(Echo::Stub* stub, size_t n) {
    Blob req;
    req.set_data(grpc_rdma_test::Pattern(n, 3));
    auto once = [&](uint32_t count) {
      req.set_repeat(count);
      grpc::ClientContext ctx;
      auto t0 = Clock::now();
      auto r = stub->Download(&ctx, req);
      Blob b;
      uint32_t got = 0;
      while (r->Read(&b)) {
        if (b.data().size() != n || (got == 0 && b.data() != req.data()))
          Die("download " + std::to_string(n) + " B: message " + std::to_string(got) +
              " came back different");
        ++got;
      }
      grpc::Status s = r->Finish();
      double t = Seconds(Clock::now() - t0);
      if (!s.ok()) Die("download " + std::to_string(n) + " B failed: " + s.error_message());
      if (got != count)
        Die("download " + std::to_string(n) + " B: " + std::to_string(got) + " messages of " +
            std::to_string(count));
      return t;
    };
    auto count_for = [&](double secs, double per_msg_s) {
      double c = secs / std::max(per_msg_s, 1e-7);
      return static_cast<uint32_t>(std::clamp(c, 8.0, 1e7));
    };
    double probe = once(8) / 8;  // also the first warm-up
    // Warm-up as for the client stream: at least 0.5 s on this channel.
    uint32_t warm = count_for(std::max(0.5, a_.seconds), probe);
    double per_msg = once(warm) / warm;
    uint32_t count = count_for(a_.seconds, per_msg);
    auto copies0 = grpc_rdma_test::RdmaStats();
    CpuMark m0 = MarkCpu(a_);
    double t = once(count);
    CpuMark m1 = MarkCpu(a_);
    std::string copies = CopiesJson(copies0, grpc_rdma_test::RdmaStats());
    double bytes = static_cast<double>(count) * n;
    printf("{\"suite\":\"download\",\"size\":%zu,\"mb_per_s\":%.1f%s%s}\n", n,
           bytes / t / 1e6, CpuJson(a_, m0, m1, bytes / 1e9).c_str(), copies.c_str());
    fflush(stdout);
  }

  void Rate() {
    std::vector<std::unique_ptr<Echo::Stub>> stubs;
    for (int i = 0; i < a_.clients; ++i) stubs.push_back(Stub());
    std::atomic<uint64_t> calls{0};
    std::atomic<bool> counting{false}, stop{false};
    std::vector<std::thread> threads;
    for (int i = 0; i < a_.clients; ++i) {
      threads.emplace_back([&, i] {
        Blob req, resp;
        req.set_data(std::string(64, 'x'));
        while (!stop) {
          grpc::ClientContext ctx;
          if (!stubs[i]->Unary(&ctx, req, &resp).ok()) Die("rate: a call failed");
          if (counting) ++calls;
        }
      });
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // warm-up
    // The marks inside the counted window: CPU and calls over the same time.
    counting = true;
    CpuMark m0 = MarkCpu(a_);
    auto t0 = Clock::now();
    std::this_thread::sleep_for(std::chrono::duration<double>(a_.seconds));
    double t = Seconds(Clock::now() - t0);
    CpuMark m1 = MarkCpu(a_);
    counting = false;
    uint64_t n = calls;
    stop = true;
    for (auto& th : threads) th.join();
    printf("{\"suite\":\"rate\",\"clients\":%d,\"calls_per_s\":%.0f%s}\n", a_.clients, n / t,
           CpuJson(a_, m0, m1, static_cast<double>(n)).c_str());
    fflush(stdout);
  }

  // The first call on a new channel: name resolution, connect (TCP, then
  // for RDMA the connection manager's exchange and the engine's hello),
  // HTTP/2 settings, then the call. Channels are closed after their call,
  // so one connection at a time lives and the server sees a steady state.
  void Connect() {
    Blob req, resp;
    req.set_data(std::string(64, 'x'));
    auto once = [&] {
      auto t0 = Clock::now();
      auto stub = Stub();
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
      grpc::Status s = stub->Unary(&ctx, req, &resp);
      double us = Seconds(Clock::now() - t0) * 1e6;
      if (!s.ok()) Die("connect: a first call failed: " + s.error_message());
      return us;
    };
    for (int i = 0; i < 3; ++i) once();  // warm-up: the server's first accepts
    std::vector<double> us;
    auto end = Clock::now() + std::chrono::duration<double>(a_.seconds);
    while ((Clock::now() < end || us.size() < 20) && us.size() < 2000) {
      us.push_back(once());
      if (a_.gap_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(a_.gap_ms));
    }
    std::sort(us.begin(), us.end());
    printf("{\"suite\":\"connect\",\"n\":%zu,\"gap_ms\":%d,\"p50_us\":%.2f,\"p99_us\":%.2f}\n",
           us.size(), a_.gap_ms, us[us.size() / 2], us[std::min(us.size() - 1, us.size() * 99 / 100)]);
    fflush(stdout);
  }

  void ParameterServer() {
    std::vector<uint64_t> vars = grpc_rdma_bench::ModelVariables(a_.model);
    if (vars.empty()) Die("--model: expected resnet50 or vgg16");
    uint64_t bytes = 0;
    std::vector<Blob> grads(vars.size());
    for (size_t i = 0; i < vars.size(); ++i) {
      grads[i].set_data(std::string(vars[i] * 4, static_cast<char>(i)));
      bytes += vars[i] * 4;
    }
    std::vector<std::unique_ptr<Echo::Stub>> stubs;
    for (int w = 0; w < a_.workers; ++w) stubs.push_back(Stub());
    auto step = [&](Echo::Stub* stub) {
      grpc::CompletionQueue cq;
      std::vector<grpc::ClientContext> ctx(vars.size());
      std::vector<Blob> resp(vars.size());
      std::vector<grpc::Status> st(vars.size());
      std::vector<std::unique_ptr<grpc::ClientAsyncResponseReader<Blob>>> rpc(vars.size());
      for (size_t i = 0; i < vars.size(); ++i) {
        rpc[i] = stub->AsyncUnary(&ctx[i], grads[i], &cq);
        rpc[i]->Finish(&resp[i], &st[i], reinterpret_cast<void*>(i));
      }
      for (size_t k = 0; k < vars.size(); ++k) {
        void* tag;
        bool ok;
        if (!cq.Next(&tag, &ok) || !ok) Die("ps: completion queue failed");
      }
      for (size_t i = 0; i < vars.size(); ++i) {
        if (!st[i].ok()) Die("ps: variable " + std::to_string(i) + ": " + st[i].error_message());
        if (resp[i].data().size() != grads[i].data().size()) Die("ps: short parameter");
      }
      cq.Shutdown();
      void* tag;
      bool ok;
      while (cq.Next(&tag, &ok)) {
      }
    };
    auto run = [&](int steps) {
      std::vector<std::thread> threads;
      auto t0 = Clock::now();
      for (int w = 0; w < a_.workers; ++w) {
        threads.emplace_back([&, w] {
          for (int s = 0; s < steps; ++s) step(stubs[w].get());
        });
      }
      for (auto& th : threads) th.join();
      return Seconds(Clock::now() - t0);
    };
    run(1);  // warm-up
    auto copies0 = grpc_rdma_test::RdmaStats();
    CpuMark m0 = MarkCpu(a_);
    double t = run(a_.steps);
    CpuMark m1 = MarkCpu(a_);
    std::string copies = CopiesJson(copies0, grpc_rdma_test::RdmaStats());
    // CPU per step (microseconds), client (all workers) and server.
    printf("{\"suite\":\"ps\",\"model\":\"%s\",\"workers\":%d,\"variables\":%zu,"
           "\"bytes_per_step\":%llu,\"steps_per_s\":%.3f%s%s}\n",
           a_.model.c_str(), a_.workers, vars.size(), static_cast<unsigned long long>(bytes),
           a_.steps / t, CpuJson(a_, m0, m1, a_.steps).c_str(), copies.c_str());
    fflush(stdout);
  }

 private:
  const Args& a_;
  grpc_rdma_test::EchoService service_;
  std::unique_ptr<grpc::Server> server_;
};

int Usage() {
  fprintf(stderr,
          "usage: grpc_bench serve ADDR\n"
          "       grpc_bench run (--target HOST:PORT | --inprocess) "
          "(latency --sizes N,... | stream --sizes N,... | rate [--clients N] |\n"
          "         connect [--gap-ms G] | ps [--model resnet50|vgg16] [--workers W] [--steps S])\n"
          "         [--seconds X]\n"
          "         [--server-pid P]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 3 && std::string(argv[1]) == "serve") {
    grpc_rdma_test::ServeOptions o;
    o.grace_s = 1;
    return grpc_rdma_test::ServeUntilStdinCloses(argv[2], grpc::InsecureServerCredentials(), o);
  }
  if (argc < 3 || std::string(argv[1]) != "run") return Usage();
  Args a;
  for (int i = 2; i < argc; ++i) {
    std::string k = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) Die(k + " needs a value");
      return argv[++i];
    };
    if (k == "--target") a.target = next();
    else if (k == "--inprocess") a.inprocess = true;
    else if (k == "--sizes") a.sizes = ParseSizes(next());
    else if (k == "--clients") a.clients = std::max(1, atoi(next().c_str()));
    else if (k == "--model") a.model = next();
    else if (k == "--workers") a.workers = std::max(1, atoi(next().c_str()));
    else if (k == "--steps") a.steps = std::max(1, atoi(next().c_str()));
    else if (k == "--seconds") a.seconds = atof(next().c_str());
    else if (k == "--gap-ms") a.gap_ms = std::max(0, atoi(next().c_str()));
    else if (k == "--server-pid") {
      a.server_pid = atoi(next().c_str());
      if (a.server_pid <= 0) Die("--server-pid: expected a process id");
    }
    else if (k[0] != '-' && a.suite.empty()) a.suite = k;
    else return Usage();
  }
  if (a.target.empty() == !a.inprocess) return Usage();
  if ((a.suite == "latency" || a.suite == "stream") && a.sizes.empty()) Die("--sizes is needed");
  if (!(a.seconds > 0)) Die("--seconds must be above 0");
  Bench b(a);
  if (a.suite == "latency") b.Latency();
  else if (a.suite == "stream") b.Stream();
  else if (a.suite == "rate") b.Rate();
  else if (a.suite == "connect") b.Connect();
  else if (a.suite == "ps") b.ParameterServer();
  else return Usage();
  return 0;
}
