// set_mlp_activation_recompute over every family whose MLP can recompute.

#include <colossalai/models/bloom.h>
#include <colossalai/models/gpt2.h>
#include <colossalai/models/llama.h>

namespace colossalai {
namespace models {

int64_t set_mlp_activation_recompute(torch::nn::Module& model, bool on) {
  int64_t n = 0;
  for (const auto& m : model.modules()) {
    if (auto* llama = dynamic_cast<LlamaMLPImpl*>(m.get())) {
      llama->recompute_activation = on;
      ++n;
    } else if (auto* gpt2 = dynamic_cast<GPT2MLPImpl*>(m.get())) {
      gpt2->recompute_activation = on;
      ++n;
    } else if (auto* bloom = dynamic_cast<BloomMLPImpl*>(m.get())) {
      bloom->recompute_activation = on;
      ++n;
    }
  }
  return n;
}

} // namespace models
} // namespace colossalai
