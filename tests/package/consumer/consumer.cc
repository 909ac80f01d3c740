// A gRPC program that links an installed grpc-rdma: a server and a client
// in one process, one call to a generic echo method (no generated code, so
// no protoc in the test), checked byte for byte, then the library's stats
// say which transport carried it.
//
// Exit status: 0 when the call succeeded over RDMA, 1 otherwise (the
// reason on stderr).
#include <grpc_rdma/grpc_rdma.h>
#include <grpc_rdma/version.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

namespace {

// Any method: reads one message and sends it back.
class Echo final : public grpc::ServerGenericBidiReactor {
 public:
  Echo() { StartRead(&message_); }
  void OnReadDone(bool ok) override {
    if (ok) {
      StartWriteAndFinish(&message_, grpc::WriteOptions(), grpc::Status::OK);
    } else {
      Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no request"));
    }
  }
  void OnDone() override { delete this; }

 private:
  grpc::ByteBuffer message_;
};

class EchoService final : public grpc::CallbackGenericService {
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext*) override {
    return new Echo;
  }
};

std::string Flatten(const grpc::ByteBuffer& b) {
  std::vector<grpc::Slice> slices;
  std::string out;
  if (!b.Dump(&slices).ok()) return out;
  for (const grpc::Slice& s : slices)
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

}  // namespace

int main() {
  std::cout << "grpc-rdma " << GRPC_RDMA_VERSION_STRING << " (for gRPC "
            << GRPC_RDMA_GRPC_VERSION_STRING << "), installed: "
            << (grpc_rdma::Installed() ? "yes" : "no") << "\n";
  EchoService service;
  grpc::ServerBuilder builder;
  builder.RegisterCallbackGenericService(&service);
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    std::cerr << "consumer: the server did not start\n";
    return 1;
  }
  // One call, checked to ride RDMA: the channel waits for RDMA CM instead
  // of starting on TCP (the default, whose first calls ride TCP).
  grpc::ChannelArguments args;
  args.SetInt(GRPC_RDMA_ARG_TCP_FIRST, 0);
  auto channel = grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(port),
                                           grpc::InsecureChannelCredentials(), args);
  grpc::GenericStub stub(channel);
  grpc::CompletionQueue cq;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  std::string sent(100000, '\0');
  for (size_t i = 0; i < sent.size(); ++i) sent[i] = static_cast<char>(i * 7 + i / 251);
  grpc::Slice slice(sent);
  grpc::ByteBuffer request(&slice, 1);
  auto call = stub.PrepareUnaryCall(&ctx, "/consumer.Echo/Echo", request, &cq);
  call->StartCall();
  grpc::ByteBuffer response;
  grpc::Status status;
  call->Finish(&response, &status, reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  if (!cq.Next(&tag, &ok) || !ok) {
    std::cerr << "consumer: the call did not complete\n";
    return 1;
  }
  if (!status.ok()) {
    std::cerr << "consumer: the echo call failed: " << status.error_message() << "\n";
    return 1;
  }
  if (Flatten(response) != sent) {
    std::cerr << "consumer: the echo came back different (" << response.Length() << " of "
              << sent.size() << " bytes)\n";
    return 1;
  }
  grpc_rdma::Stats st = grpc_rdma::GetStats();
  std::cout << "echo: " << sent.size() << " bytes there and back; rdma_client_connections="
            << st.rdma_client_connections << " tcp_client_connections="
            << st.tcp_client_connections << "\n";
  server->Shutdown();
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  if (st.rdma_client_connections == 0 || st.tcp_client_connections != 0) {
    std::cerr << "consumer: the call did not ride RDMA\n";
    return 1;
  }
  return 0;
}
