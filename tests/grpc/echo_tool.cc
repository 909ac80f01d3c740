// echo_tool: the Echo service as two separate programs, for tests across
// processes and network namespaces (tests/grpc/run_interop.sh). Public
// grpc++ API only; grpc-rdma is preloaded or not, as the test wants.
//
//   echo_tool serve ADDR:PORT [--tls CERT KEY] [--max-idle-ms N] [--heap-file F]
//                                      prints "port N" and serves until
//                                      stdin closes; --max-idle-ms: closes a
//                                      connection with no call for N ms;
//                                      --heap-file: writes malloc's heap in
//                                      use (bytes) and a count of writes to
//                                      F every second
//   echo_tool call TARGET [--tls CA HOST]  unary calls of several sizes on
//                                      three channels, one after the other;
//                                      checks every byte; exit 0 when all
//                                      came back
//   echo_tool pingpong TARGET CALLS [--tls CA HOST]
//                                      CALLS 64 B unary calls on one
//                                      channel, one after the other (a
//                                      small-call ping-pong); checks every
//                                      byte
//   echo_tool idle TARGET SECONDS      one call, then holds the channel
//                                      open and idle; prints "idle" first
//   echo_tool watch TARGET             a long server stream; prints
//                                      "streaming" once it flows, then reads
//                                      until it ends; exit 0 when it ended
//                                      with an error (the test kills the
//                                      server), 1 when it ended OK
//
// Exit codes: 0 ok, 1 an RPC failed or came back wrong, 2 bad usage.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

#include "echo_service.h"

namespace {

using grpc_rdma::test::Blob;
using grpc_rdma::test::Echo;

std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

int Serve(const std::string& addr, const std::string& cert, const std::string& key,
          const grpc_rdma_test::ServeOptions& options) {
  std::shared_ptr<grpc::ServerCredentials> creds = grpc::InsecureServerCredentials();
  if (!cert.empty()) {
    grpc::SslServerCredentialsOptions o;
    o.pem_key_cert_pairs.push_back({ReadFile(key), ReadFile(cert)});
    creds = grpc::SslServerCredentials(o);
  }
  return grpc_rdma_test::ServeUntilStdinCloses(addr, creds, options);
}

// One unary call of `n` pattern bytes (`seed`), its answer checked: true
// when every byte came back. `what` names the call in the messages.
bool CheckedUnary(Echo::Stub& stub, size_t n, uint32_t seed, const std::string& what,
                  Blob* resp) {
  Blob req;
  req.set_data(grpc_rdma_test::Pattern(n, seed));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  grpc::Status s = stub.Unary(&ctx, req, resp);
  if (!s.ok()) {
    fprintf(stderr, "echo_tool: %s: %s (code %d)\n", what.c_str(), s.error_message().c_str(),
            static_cast<int>(s.error_code()));
    return false;
  }
  if (resp->data() != req.data()) {
    fprintf(stderr, "echo_tool: %s came back different\n", what.c_str());
    return false;
  }
  return true;
}

// TLS with `ca` as the root and `host` as the name expected, if `ca` is
// given; plaintext otherwise.
std::shared_ptr<grpc::ChannelCredentials> ClientCreds(const std::string& ca,
                                                      const std::string& host,
                                                      grpc::ChannelArguments* args) {
  if (ca.empty()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions o;
  o.pem_root_certs = ReadFile(ca);
  if (!host.empty()) args->SetSslTargetNameOverride(host);
  return grpc::SslCredentials(o);
}

int Call(const std::string& target, const std::string& ca, const std::string& host) {
  grpc::ChannelArguments args = grpc_rdma_test::BigMessageArgs();
  std::shared_ptr<grpc::ChannelCredentials> creds = ClientCreds(ca, host, &args);
  const size_t kSizes[] = {0, 1, 8192, 8193, 100000, 1 << 20, (4 << 20) + 1};
  uint32_t seed = 1;
  // Three channels: the third shows what the first two taught the plugin
  // (an address TCP reached twice where RDMA did not goes straight to TCP).
  for (int channel = 0; channel < 3; ++channel) {
  args.SetInt("echo_tool.channel", channel);
  auto stub = Echo::NewStub(grpc::CreateCustomChannel(target, creds, args));
  for (size_t n : kSizes) {
    Blob resp;
    if (!CheckedUnary(*stub, n, seed++, std::to_string(n) + " bytes", &resp)) return 1;
    printf("ok %zu bytes, server saw peer %s\n", n, resp.peer().c_str());
  }
  }
  return 0;
}

int PingPong(const std::string& target, int calls, const std::string& ca,
             const std::string& host) {
  grpc::ChannelArguments args = grpc_rdma_test::BigMessageArgs();
  std::shared_ptr<grpc::ChannelCredentials> creds = ClientCreds(ca, host, &args);
  auto stub = Echo::NewStub(grpc::CreateCustomChannel(target, creds, args));
  for (int i = 0; i < calls; ++i) {
    Blob resp;
    if (!CheckedUnary(*stub, 64, static_cast<uint32_t>(i), "call " + std::to_string(i), &resp))
      return 1;
  }
  printf("ok %d calls\n", calls);
  return 0;
}

int Watch(const std::string& target) {
  auto stub = Echo::NewStub(
      grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(),
                                grpc_rdma_test::BigMessageArgs()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  Blob req, b;
  req.set_data(grpc_rdma_test::Pattern(50000, 3));
  req.set_repeat(1000000);
  req.set_delay_ms(5);
  auto r = stub->Download(&ctx, req);
  int n = 0;
  while (r->Read(&b)) {
    if (++n == 3) {
      printf("streaming\n");
      fflush(stdout);
    }
  }
  grpc::Status s = r->Finish();
  printf("stream ended after %d messages: code %d (%s)\n", n, static_cast<int>(s.error_code()),
         s.error_message().c_str());
  return s.ok() ? 1 : 0;
}

int Idle(const std::string& target, int seconds) {
  auto stub = Echo::NewStub(grpc::CreateCustomChannel(
      target, grpc::InsecureChannelCredentials(), grpc_rdma_test::BigMessageArgs()));
  Blob req, resp;
  req.set_data("hello");
  grpc::ClientContext ctx;
  if (!stub->Unary(&ctx, req, &resp).ok()) return 1;
  printf("idle\n");
  fflush(stdout);
  sleep(static_cast<unsigned>(seconds));
  return 0;
}

int Usage() {
  fprintf(stderr,
          "usage: echo_tool serve ADDR:PORT [--tls CERT KEY] [--max-idle-ms N] [--heap-file F]\n"
          "       echo_tool call TARGET [--tls CA HOSTNAME]\n"
          "       echo_tool watch TARGET\n"
          "       echo_tool pingpong TARGET CALLS [--tls CA HOSTNAME]\n"
          "       echo_tool idle TARGET SECONDS\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) return Usage();
  std::string mode = argv[1], addr = argv[2], a, b;
  if (mode == "serve") {
    grpc_rdma_test::ServeOptions o;
    for (int i = 3; i < argc; ++i) {
      std::string opt = argv[i];
      if (opt == "--tls" && i + 2 < argc) {
        a = argv[++i];
        b = argv[++i];
      } else if (opt == "--max-idle-ms" && i + 1 < argc && atoi(argv[i + 1]) > 0) {
        o.max_idle_ms = atoi(argv[++i]);
      } else if (opt == "--heap-file" && i + 1 < argc) {
        o.heap_file = argv[++i];
      } else {
        return Usage();
      }
    }
    return Serve(addr, a, b, o);
  }
  if (mode == "pingpong" && argc == 7 && std::string(argv[4]) == "--tls") {
    int calls = atoi(argv[3]);
    return calls > 0 ? PingPong(addr, calls, argv[5], argv[6]) : Usage();
  }
  if (argc == 6 && std::string(argv[3]) == "--tls") {
    a = argv[4];
    b = argv[5];
  } else if (argc == 4 && (mode == "idle" || mode == "pingpong")) {
    a = argv[3];
  } else if (argc != 3) {
    return Usage();
  }
  if (mode == "call") return Call(addr, a, b);
  if (mode == "watch") return Watch(addr);
  if (mode == "idle" && !a.empty() && b.empty()) return Idle(addr, atoi(a.c_str()));
  if (mode == "pingpong" && atoi(a.c_str()) > 0) return PingPong(addr, atoi(a.c_str()), "", "");
  return Usage();
}
