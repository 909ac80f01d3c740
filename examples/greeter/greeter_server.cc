// A plain gRPC greeter server: stock grpc++ code, no reference to
// grpc-rdma. Run it with the plugin preloaded and it also serves RDMA:
//
//   LD_PRELOAD=libgrpc_rdma.so ./greeter_server 0.0.0.0:50051
#include <grpcpp/grpcpp.h>

#include <iostream>
#include <string>

#include "greeter.grpc.pb.h"

class GreeterService final : public greeter::Greeter::Service {
  grpc::Status SayHello(grpc::ServerContext* ctx, const greeter::HelloRequest* req,
                        greeter::HelloReply* reply) override {
    reply->set_message("Hello " + req->name() + " (you came from " + ctx->peer() + ")");
    return grpc::Status::OK;
  }
};

int main(int argc, char** argv) {
  std::string addr = argc > 1 ? argv[1] : "0.0.0.0:50051";
  GreeterService service;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(addr, grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server) {
    std::cerr << "cannot listen on " << addr << "\n";
    return 1;
  }
  std::cout << "greeter listening on port " << port << std::endl;
  server->Wait();
  return 0;
}
