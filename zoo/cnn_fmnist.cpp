#include <zoo/cnn_fmnist.h>

#include <torch/torch.h>

namespace colossalai {
namespace zoo {

namespace {

torch::nn::Conv2d conv3x3(int64_t in, int64_t out, int64_t stride) {
  // No bias: the BatchNorm that follows would cancel it.
  return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3)
                               .stride(stride)
                               .padding(1)
                               .bias(false));
}

} // namespace

ResidualBlockImpl::ResidualBlockImpl(int64_t channels) {
  conv1 = register_module("conv1", conv3x3(channels, channels, 1));
  bn1 = register_module("bn1", torch::nn::BatchNorm2d(channels));
  conv2 = register_module("conv2", conv3x3(channels, channels, 1));
  bn2 = register_module("bn2", torch::nn::BatchNorm2d(channels));
}

at::Tensor ResidualBlockImpl::forward(const at::Tensor& x) {
  auto h = torch::relu(bn1->forward(conv1->forward(x)));
  h = bn2->forward(conv2->forward(h));
  return torch::relu(x + h);
}

CNNFashionMNISTImpl::CNNFashionMNISTImpl() {
  conv1 = register_module("conv1", conv3x3(1, 16, 1));
  bn1 = register_module("bn1", torch::nn::BatchNorm2d(16));
  conv2 = register_module("conv2", conv3x3(16, 32, 2));
  bn2 = register_module("bn2", torch::nn::BatchNorm2d(32));
  res1 = register_module("res1", ResidualBlock(32));
  conv3 = register_module("conv3", conv3x3(32, 64, 2));
  bn3 = register_module("bn3", torch::nn::BatchNorm2d(64));
  res2 = register_module("res2", ResidualBlock(64));
  fc = register_module("fc", torch::nn::Linear(64 * 7 * 7, kNumClasses));
}

at::Tensor CNNFashionMNISTImpl::forward(const at::Tensor& x) {
  TORCH_CHECK(
      x.dim() == 4 && x.size(1) == 1 && x.size(2) == 28 && x.size(3) == 28,
      "CNNFashionMNIST: expected input [B, 1, 28, 28], got ",
      x.sizes());
  auto h = torch::relu(bn1->forward(conv1->forward(x)));
  h = torch::relu(bn2->forward(conv2->forward(h)));
  h = res1->forward(h);
  h = torch::relu(bn3->forward(conv3->forward(h)));
  h = res2->forward(h);
  return fc->forward(h.flatten(1)); // [B, 64 * 7 * 7] -> [B, 10]
}

} // namespace zoo
} // namespace colossalai
