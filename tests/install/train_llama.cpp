// Trains a LLaMA read from a transformers-written directory with
// HybridParallel tensor parallel 2 x pipeline parallel 2 (4 ranks), as a
// program outside the tree would: only the installed headers and
// colossalai::models. Exits 0 when the loss of a repeated batch fell.
//
//   colossalai run --nproc_per_node 4 ./train_llama DIR

#include <colossalai/booster/booster.h>
#include <colossalai/booster/plugin/hybrid_parallel_plugin.h>
#include <colossalai/distributed/error.h>
#include <colossalai/initialize.h>
#include <colossalai/models/pretrained.h>
#include <colossalai/pipeline/schedule.h>
#include <colossalai/pipeline/stage_manager.h>

#include <torch/torch.h>

#include <iostream>

namespace cb = colossalai::booster;
namespace models = colossalai::models;

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: colossalai run --nproc_per_node 4 " << argv[0]
              << " DIR\n";
    return 2;
  }
  try {
    colossalai::launch_from_env();
    at::set_num_threads(1);
    auto model = models::from_pretrained<models::LlamaForCausalLM>(argv[1]);
    auto plugin = std::make_shared<cb::plugin::HybridParallelPlugin>(
        cb::plugin::HybridParallelPluginOptions()
            .tp_size(2)
            .pp_size(2)
            .num_microbatches(2)
            .precision("fp32"));
    cb::Booster booster(cb::BoosterOptions().plugin(plugin));
    auto optimizer = std::make_shared<torch::optim::AdamW>(
        model->parameters(), torch::optim::AdamWOptions(1e-3));
    auto boosted = booster.boost(model, optimizer);
    torch::manual_seed(0);
    auto tokens = torch::randint(model->config().vocab_size(), {4, 17});
    auto x = tokens.narrow(1, 0, 16), y = tokens.narrow(1, 1, 16);
    const bool last = plugin->stage_manager()->holds_last_stage();
    double first = 0, loss = 0;
    for (int step = 0; step < 5; ++step) {
      boosted.optimizer->zero_grad();
      auto out = booster.execute_pipeline(
          [&] {
            return colossalai::pipeline::Batch{x, y};
          },
          boosted.model,
          [&](const at::Tensor& logits, const colossalai::pipeline::Batch& mb) {
            return model->loss(logits, mb[1]);
          },
          boosted.optimizer.get());
      boosted.optimizer->step();
      if (last) {
        loss = out.loss.item<double>();
        first = step == 0 ? loss : first;
        std::cout << "step " << step << " loss " << loss << std::endl;
      }
    }
    if (last && !(loss < first)) {
      std::cerr << "the loss did not fall: " << first << " -> " << loss << "\n";
      return 1;
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "error: " << colossalai::distributed::error_text(e) << "\n";
    return 1;
  }
}
