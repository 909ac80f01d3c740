// A plain gRPC greeter client: stock grpc++ code, no reference to
// grpc-rdma.
//
//   LD_PRELOAD=libgrpc_rdma.so ./greeter_client 10.0.0.1:50051 world
#include <grpcpp/grpcpp.h>

#include <iostream>
#include <string>

#include "greeter.grpc.pb.h"

int main(int argc, char** argv) {
  std::string target = argc > 1 ? argv[1] : "127.0.0.1:50051";
  std::string name = argc > 2 ? argv[2] : "world";
  auto stub = greeter::Greeter::NewStub(
      grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  greeter::HelloRequest req;
  req.set_name(name);
  greeter::HelloReply reply;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::Status s = stub->SayHello(&ctx, req, &reply);
  if (!s.ok()) {
    std::cerr << "SayHello failed: " << s.error_message() << "\n";
    return 1;
  }
  std::cout << reply.message() << std::endl;
  return 0;
}
