#include <colossalai/initialize.h>

#include <colossalai/distributed/collectives.h>
#include <colossalai/distributed/error.h>
#include <colossalai/launcher.h>
#include <colossalai/utils/env.h>

#include "distributed/runtime.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/cuda.h>

#include <iostream>

namespace colossalai {

namespace dd = distributed::detail;

std::string distributed::error_text(const std::exception& e) {
  if (auto* ce = dynamic_cast<const c10::Error*>(&e)) {
    return ce->what_without_backtrace();
  }
  return e.what();
}

namespace {

bool is_loopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

} // namespace

void launch(const LaunchOptions& o) {
  auto& rt = dd::runtime();
  std::lock_guard<std::mutex> lock(rt.mutex);
  TORCH_CHECK(!rt.initialized, "colossalai::launch: already launched");
  TORCH_CHECK(
      o.world_size() >= 1,
      "colossalai::launch: world_size must be >= 1, got ",
      o.world_size());
  TORCH_CHECK(
      o.rank() >= 0 && o.rank() < o.world_size(),
      "colossalai::launch: rank must be in [0, world_size=",
      o.world_size(),
      "), got ",
      o.rank());
  TORCH_CHECK(
      o.port() > 0 && o.port() < 65536,
      "colossalai::launch: port must be in [1, 65535], got ",
      o.port());
  TORCH_CHECK(
      o.timeout().count() > 0, "colossalai::launch: timeout must be positive");
  TORCH_CHECK(
      o.backend() == "auto" || o.backend() == "gloo" || o.backend() == "nccl",
      "colossalai::launch: backend must be 'auto', 'gloo' or 'nccl', got '",
      o.backend(),
      "'");

  bool cuda = torch::cuda::is_available();
  bool nccl = o.backend() == "nccl" || (o.backend() == "auto" && cuda);
#ifndef COLOSSALAI_WITH_CUDA
  TORCH_CHECK(
      !(nccl && o.backend() == "nccl"),
      "colossalai::launch: backend 'nccl' needs a LibTorch with CUDA; this "
      "build has none (use backend 'gloo')");
  nccl = false;
#endif
  TORCH_CHECK(
      !nccl || cuda, "colossalai::launch: backend 'nccl' needs a CUDA device");

  ::c10d::TCPStoreOptions so;
  so.port = static_cast<std::uint16_t>(o.port());
  so.isServer = o.rank() == 0;
  so.numWorkers = static_cast<std::size_t>(o.world_size());
  so.waitWorkers = true;
  so.timeout = o.timeout();
  try {
    rt.store = c10::make_intrusive<::c10d::TCPStore>(o.host(), so);
  } catch (const std::exception& e) {
    throw distributed::DistributedError(
        "rank " + std::to_string(o.rank()) + ": rendezvous at " + o.host() +
        ":" + std::to_string(o.port()) + " failed within " +
        std::to_string(o.timeout().count()) + " ms (world_size " +
        std::to_string(o.world_size()) +
        "; is the master reachable and every rank started?): " +
        distributed::error_text(e));
  }

  rt.rank = o.rank();
  rt.world_size = o.world_size();
  rt.timeout = o.timeout();
  rt.host = o.host();
  rt.backend =
      nccl ? distributed::BackendType::kNccl : distributed::BackendType::kGloo;
  if (nccl) {
    int count = static_cast<int>(torch::cuda::device_count());
    int local = o.local_rank() >= 0 ? o.local_rank() : o.rank() % count;
    rt.device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local));
  } else {
    if (auto ifname = utils::gloo_socket_ifname()) {
      rt.gloo_device =
          ::c10d::ProcessGroupGloo::createDeviceForInterface(*ifname);
    } else if (is_loopback(o.host())) {
      rt.gloo_device =
          ::c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
    } else {
      rt.gloo_device = ::c10d::ProcessGroupGloo::createDefaultDevice();
    }
    rt.device = c10::Device(c10::kCPU);
  }
  std::vector<int> all(rt.world_size);
  for (int r = 0; r < rt.world_size; ++r) {
    all[r] = r;
  }
  rt.initialized = true;
  try {
    rt.world = dd::create_group(rt, all, "world");
    // Nobody leaves the rendezvous before everyone has connected: a fast rank
    // that exits early would otherwise break a slow rank's mesh setup.
    distributed::barrier(*rt.world).wait();
  } catch (...) {
    rt.initialized = false;
    rt.store.reset();
    throw;
  }
}

void launch_from_env(LaunchOptions base) {
  auto env = utils::read_dist_env();
  if (env.source.empty()) {
    // Started by hand: one process, as torch.distributed users expect from
    // a script that runs fine without a launcher.
    std::cerr << "colossalai: no launcher variables (RANK/WORLD_SIZE, "
                 "OMPI_COMM_WORLD_*, SLURM_*); running as one process "
                 "(world size 1)"
              << std::endl;
    base.rank(0)
        .world_size(1)
        .host("127.0.0.1")
        .port(launcher::find_free_port());
    launch(base);
    return;
  }
  const char* rank_var = env.source == "torchrun" ? "RANK"
      : env.source == "openmpi"                   ? "OMPI_COMM_WORLD_RANK"
                                                  : "SLURM_PROCID";
  const char* size_var = env.source == "torchrun" ? "WORLD_SIZE"
      : env.source == "openmpi"                   ? "OMPI_COMM_WORLD_SIZE"
                                                  : "SLURM_NTASKS";
  TORCH_CHECK(
      env.rank.has_value(),
      "launch_from_env (",
      env.source,
      "): ",
      rank_var,
      " is not set");
  TORCH_CHECK(
      env.world_size.has_value(),
      "launch_from_env (",
      env.source,
      "): ",
      size_var,
      " is not set");
  base.rank(*env.rank).world_size(*env.world_size);
  if (env.local_rank) {
    base.local_rank(*env.local_rank);
  }
  if (env.master_addr) {
    base.host(*env.master_addr);
  } else {
    TORCH_CHECK(
        env.world_size == 1 || env.source != "torchrun",
        "launch_from_env: MASTER_ADDR is not set");
  }
  if (env.master_port) {
    base.port(*env.master_port);
  } else {
    TORCH_CHECK(
        env.world_size == 1 || env.source != "torchrun",
        "launch_from_env: MASTER_PORT is not set");
  }
  launch(base);
}

void destroy() {
  auto& rt = dd::runtime();
  std::lock_guard<std::mutex> lock(rt.mutex);
  rt.world.reset();
  rt.store.reset();
  rt.gloo_device.reset();
  rt.group_name_uses.clear();
  rt.initialized = false;
}

c10::Device current_device() {
  return dd::runtime().device;
}

} // namespace colossalai
