// File: benchmarks/models.h
//
// The trainable variables of ResNet-50 (v1.5, as tf_cnn_benchmarks builds
// it: conv kernels without bias, batch-norm gamma and beta, the final
// dense layer) and VGG-16 (13 conv and 3 dense layers, each with a bias),
// as element counts of float32 tensors: what a worker pushes as gradients
// and pulls back as parameters each step with
// --variable_update=parameter_server.
#ifndef GRPC_RDMA_BENCHMARKS_MODELS_H_
#define GRPC_RDMA_BENCHMARKS_MODELS_H_

#include <cstdint>
#include <string>
#include <vector>

namespace grpc_rdma_bench {

inline std::vector<uint64_t> ResNet50Variables() {
  std::vector<uint64_t> v;
  auto conv_bn = [&v](uint64_t k, uint64_t in, uint64_t out) {
    v.push_back(k * k * in * out);  // kernel
    v.push_back(out);               // gamma
    v.push_back(out);               // beta
  };
  conv_bn(7, 3, 64);
  const int blocks[] = {3, 4, 6, 3};
  const uint64_t widths[] = {64, 128, 256, 512};
  uint64_t in = 64;
  for (int s = 0; s < 4; ++s) {
    uint64_t w = widths[s], out = 4 * w;
    for (int b = 0; b < blocks[s]; ++b) {
      if (b == 0) conv_bn(1, in, out);  // projection shortcut
      conv_bn(1, in, w);
      conv_bn(3, w, w);
      conv_bn(1, w, out);
      in = out;
    }
  }
  v.push_back(2048 * 1000);  // dense kernel
  v.push_back(1000);         // dense bias
  return v;
}

inline std::vector<uint64_t> Vgg16Variables() {
  std::vector<uint64_t> v;
  const uint64_t convs[][2] = {{3, 64},    {64, 64},   {64, 128},  {128, 128}, {128, 256},
                               {256, 256}, {256, 256}, {256, 512}, {512, 512}, {512, 512},
                               {512, 512}, {512, 512}, {512, 512}};
  for (const auto& c : convs) {
    v.push_back(3 * 3 * c[0] * c[1]);
    v.push_back(c[1]);
  }
  const uint64_t dense[][2] = {{7 * 7 * 512, 4096}, {4096, 4096}, {4096, 1000}};
  for (const auto& d : dense) {
    v.push_back(d[0] * d[1]);
    v.push_back(d[1]);
  }
  return v;
}

inline std::vector<uint64_t> ModelVariables(const std::string& name) {
  if (name == "resnet50") return ResNet50Variables();
  if (name == "vgg16") return Vgg16Variables();
  return {};
}

}  // namespace grpc_rdma_bench

#endif  // GRPC_RDMA_BENCHMARKS_MODELS_H_
