// Trains a small residual CNN on Fashion-MNIST with the Booster.
//
//   train_fashion_mnist [--nproc 2] [--plugin ddp|zero2|fsdp|none]
//                       [--epochs 3]
//                       [--batch-size 64] [--precision fp32|bf16|fp16]
//                       [--lr 2e-3] [--data-dir DIR]
//
// Started directly, it launches --nproc ranks of itself (as `colossalai run`
// would); started by a launcher, it joins the launcher's ranks.

#include <colossalai/colossalai.h>
#include <colossalai/nn/lr_scheduler/cosine.h>

#include <zoo/cnn_fmnist.h>
#include <zoo/fashion_mnist.h>

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <map>
#include <sstream>
#include <thread>

namespace cb = colossalai::booster;
namespace cd = colossalai::distributed;
using colossalai::zoo::FashionMNIST;

namespace {

struct Args {
  int nproc = 2;
  std::string plugin = "ddp";
  int epochs = 3;
  int batch_size = 64; // per rank
  std::string precision = "fp32";
  double lr = 2e-3;
  std::string data_dir = FashionMNIST::default_root();
  uint64_t seed = 1024;
  std::string checkpoint = "checkpoints/fashion_mnist";
  bool resume = false;
  int save_every = 0; // batches; 0: at the end of each epoch only
};

Args parse(int argc, char** argv) {
  Args a;
  CLI::App app(
      "Trains a small residual CNN on Fashion-MNIST through the Booster.\n"
      "A checkpoint is saved in --checkpoint after every epoch and every\n"
      "--save-every batches (the newest two are kept); --resume continues\n"
      "from the newest complete one, mid-epoch too and at any --nproc, up\n"
      "to --epochs in all, or starts fresh when there is none.",
      "train_fashion_mnist");
  app.add_option("--nproc", a.nproc, "ranks to start")->capture_default_str();
  app.add_option("--plugin", a.plugin, "parallel strategy")
      ->check(CLI::IsMember({"ddp", "zero2", "fsdp", "none"}))
      ->capture_default_str();
  app.add_option("--epochs", a.epochs, "epochs in all")->capture_default_str();
  app.add_option(
         "--batch-size", a.batch_size, "samples per rank (global: N * B)")
      ->capture_default_str();
  app.add_option("--precision", a.precision, "fp16 needs CUDA")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}))
      ->capture_default_str();
  app.add_option("--lr", a.lr, "AdamW learning rate")->capture_default_str();
  app.add_option("--data-dir", a.data_dir, "Fashion-MNIST IDX files (.gz)")
      ->capture_default_str();
  app.add_option("--seed", a.seed, "random seed")->capture_default_str();
  app.add_option("--checkpoint", a.checkpoint, "checkpoint directory")
      ->capture_default_str();
  app.add_flag("--resume", a.resume, "continue from --checkpoint");
  app.add_option(
         "--save-every",
         a.save_every,
         "also save every N batches within an epoch (0: never)")
      ->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    std::exit(app.exit(e)); // --help prints and exits 0; errors exit 1+
  }
  TORCH_CHECK(a.nproc >= 1, "--nproc must be >= 1");
  TORCH_CHECK(a.save_every >= 0, "--save-every must be >= 0");
  TORCH_CHECK(a.epochs >= 1, "--epochs must be >= 1");
  TORCH_CHECK(a.batch_size >= 1, "--batch-size must be >= 1");
  TORCH_CHECK(
      a.plugin == "ddp" || a.plugin == "zero2" || a.plugin == "fsdp" ||
          a.plugin == "none",
      "--plugin must be 'ddp', 'zero2', 'fsdp' or 'none', got '",
      a.plugin,
      "'");
  TORCH_CHECK(
      a.plugin != "none" || a.nproc == 1,
      "--plugin none trains in one process: use --nproc 1");
  return a;
}

void progress(
    int epoch,
    int epochs,
    size_t step,
    size_t steps,
    double loss,
    double samples_per_s) {
  const int width = 30;
  int filled = static_cast<int>(width * step / std::max<size_t>(steps, 1));
  std::printf(
      "\repoch %d/%d [%s%s] %zu/%zu loss %.4f  %.0f samples/s",
      epoch,
      epochs,
      std::string(filled, '#').c_str(),
      std::string(width - filled, '.').c_str(),
      step,
      steps,
      loss,
      samples_per_s);
  std::fflush(stdout);
}

template <class Dataset>
std::unique_ptr<colossalai::data::DistributedDataLoader<Dataset>> make_loader(
    const std::shared_ptr<cb::plugin::DPPluginBase>& plugin,
    Dataset ds,
    size_t batch_size,
    bool shuffle,
    uint64_t seed) {
  if (plugin) {
    return plugin->prepare_dataloader(std::move(ds), batch_size, shuffle, seed);
  }
  auto size = *ds.size();
  return std::make_unique<colossalai::data::DistributedDataLoader<Dataset>>(
      std::move(ds),
      colossalai::data::DistributedSampler(size, 1, 0, shuffle, seed),
      torch::data::DataLoaderOptions(batch_size));
}

int train(const Args& a) {
  const bool distributed = a.plugin != "none";
  if (distributed) {
    colossalai::launch_from_env();
  }
  const int rank = cd::get_rank();
  const int world = cd::get_world_size();
  // Ranks share the machine's cores.
  int cores = static_cast<int>(std::thread::hardware_concurrency());
  at::set_num_threads(std::max(1, cores / world));

  FashionMNIST train_set(a.data_dir, FashionMNIST::Mode::kTrain);
  FashionMNIST test_set(a.data_dir, FashionMNIST::Mode::kTest);

  // DDP takes the precision from the Booster; ZeRO and FSDP keep fp32
  // master weights and set their compute dtype themselves.
  std::shared_ptr<cb::plugin::DPPluginBase> plugin;
  std::string booster_precision = a.precision;
  if (a.plugin == "ddp") {
    plugin = std::make_shared<cb::plugin::TorchDDPPlugin>();
  } else if (a.plugin == "zero2") {
    plugin = std::make_shared<cb::plugin::LowLevelZeroPlugin>(
        cb::plugin::LowLevelZeroPluginOptions().stage(2).precision(
            a.precision));
    booster_precision = "";
  } else if (a.plugin == "fsdp") {
    TORCH_CHECK(
        a.precision == "fp32" || a.precision == "bf16",
        "--plugin fsdp trains in fp32 or bf16");
    plugin = std::make_shared<cb::plugin::TorchFSDPPlugin>(
        cb::plugin::TorchFSDPPluginOptions().param_dtype(
            a.precision == "bf16" ? at::kBFloat16 : at::kFloat));
    booster_precision = "";
  }
  cb::Booster booster(
      cb::BoosterOptions().plugin(plugin).mixed_precision(booster_precision));

  torch::manual_seed(a.seed);
  colossalai::zoo::CNNFashionMNIST model;
  auto optimizer = std::make_shared<torch::optim::AdamW>(
      model->parameters(), torch::optim::AdamWOptions(a.lr).weight_decay(1e-4));
  cb::Criterion criterion = [](const at::Tensor& logits,
                               const at::Tensor& target) {
    return torch::nn::functional::cross_entropy(logits.to(at::kFloat), target);
  };
  auto boosted = booster.boost(model, optimizer, criterion);

  auto train_loader = make_loader(
      plugin,
      train_set.map(torch::data::transforms::Stack<>()),
      a.batch_size,
      /*shuffle=*/true,
      a.seed);
  auto test_loader = make_loader(
      plugin,
      test_set.map(torch::data::transforms::Stack<>()),
      256,
      /*shuffle=*/false,
      a.seed);
  if (rank == 0) {
    std::printf(
        "Fashion-MNIST: %zu train / %zu test images; model %lld "
        "parameters; %d rank(s) x batch %d, plugin %s, precision %s\n",
        *train_set.size(),
        *test_set.size(),
        static_cast<long long>(
            colossalai::zoo::CNNFashionMNISTImpl::kNumParameters),
        world,
        a.batch_size,
        a.plugin.c_str(),
        a.precision.c_str());
  }

  // Cosine decay of the learning rate to zero over the run: a few epochs
  // then reach a lower loss than a constant rate.
  colossalai::nn::lr_scheduler::CosineAnnealingLR scheduler(
      *optimizer, static_cast<int64_t>(a.epochs * train_loader->num_batches()));

  // NOTE [Training checkpoints]: sets committed atomically; the newest
  // complete one is where --resume starts (a fresh start without one), with
  // the loader at the same place of the same epoch, split over the ranks
  // now present.
  int first_epoch = 1;
  int64_t global_step = 0;
  if (a.resume) {
    const auto state = booster.resume_or_start(
        a.checkpoint,
        boosted.model,
        boosted.optimizer.get(),
        &scheduler,
        *train_loader);
    first_epoch = std::max(1, static_cast<int>(state.epoch()));
    global_step = state.step();
    if (rank == 0) {
      if (state.step() > 0) {
        std::printf(
            "resumed from '%s/checkpoint-%lld': epoch %lld after %lld of its "
            "samples\n",
            a.checkpoint.c_str(),
            static_cast<long long>(state.step()),
            static_cast<long long>(state.epoch()),
            static_cast<long long>(state.samples_in_epoch()));
      } else {
        std::printf(
            "no complete checkpoint under '%s': starting at epoch 1\n",
            a.checkpoint.c_str());
      }
    }
  }

  double accuracy = 0;
  for (int epoch = first_epoch; epoch <= a.epochs; ++epoch) {
    boosted.model.train();
    train_loader->set_epoch(epoch); // keeps a resume's place in it
    const size_t steps = train_loader->num_batches();
    size_t step = 0;
    double smooth = 0;
    auto t0 = std::chrono::steady_clock::now();
    for (auto& batch : *train_loader) {
      auto loss = boosted.criterion(boosted.model(batch.data), batch.target);
      booster.backward(loss, *boosted.optimizer);
      boosted.optimizer->step();
      boosted.optimizer->zero_grad();
      scheduler.step();
      ++step;
      ++global_step;
      if (a.save_every > 0 && step % a.save_every == 0 && step < steps) {
        booster.save_checkpoint(
            a.checkpoint,
            colossalai::booster::TrainingState()
                .step(global_step)
                .epoch(epoch)
                .samples_in_epoch(static_cast<int64_t>(
                    train_loader->samples_seen(step))),
            boosted.model,
            boosted.optimizer.get(),
            &scheduler);
      }
      double l = loss.item<double>();
      smooth = step == 1 ? l : 0.95 * smooth + 0.05 * l;
      if (rank == 0 && (step % 20 == 0 || step == steps)) {
        double s =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
                .count();
        progress(
            epoch,
            a.epochs,
            step,
            steps,
            smooth,
            step * a.batch_size * world / s);
      }
    }

    // Test accuracy over every rank's shard of the test set.
    boosted.model.eval();
    at::NoGradGuard no_grad;
    auto counts = at::zeros({2}, at::kDouble); // correct, seen
    for (auto& batch : *test_loader) {
      auto pred = boosted.model(batch.data).argmax(1);
      counts[0] += pred.eq(batch.target).sum().item<double>();
      counts[1] += batch.target.size(0);
    }
    if (distributed) {
      cd::all_reduce(counts, *cd::world_group()).wait();
    }
    accuracy = counts[0].item<double>() / counts[1].item<double>();
    if (rank == 0) {
      double s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
              .count();
      std::printf(
          "\nepoch %d/%d: test accuracy %.2f%% (%.0f images), %.1f s\n",
          epoch,
          a.epochs,
          100 * accuracy,
          counts[1].item<double>(),
          s);
      std::fflush(stdout);
    }
    booster.save_checkpoint(
        a.checkpoint,
        // The next epoch, from its start.
        colossalai::booster::TrainingState().step(global_step).epoch(epoch + 1),
        boosted.model,
        boosted.optimizer.get(),
        &scheduler);
  }
  if (rank == 0) {
    std::printf("checkpoint: %s\n", a.checkpoint.c_str());
    std::printf("final test accuracy: %.2f%%\n", 100 * accuracy);
  }
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  // An error ends the process with 1, and under torchrun reaches its summary.
  return colossalai::record([&] {
    Args a = parse(argc, argv);
    if (a.plugin != "none" && !colossalai::launcher::launched_by_launcher()) {
      // Fail once, here, rather than once per rank when the data is missing.
      FashionMNIST(a.data_dir, FashionMNIST::Mode::kTest);
      return colossalai::launcher::run_self(a.nproc, argc, argv);
    }
    return train(a);
  });
}
