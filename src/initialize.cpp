#include <colossalai/initialize.h>

#include <colossalai/distributed/collectives.h>
#include <colossalai/distributed/error.h>
#include <colossalai/launcher.h>
#include <colossalai/record.h>
#include <colossalai/utils/env.h>

#include "distributed/runtime.h"
#include "distributed/shm_channel.h"
#include "distributed/tcp_store_client.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/cuda.h>

#include <fcntl.h>
#include <netdb.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <atomic>
#include <future>
#include <iostream>
#include <memory>
#include <thread>

namespace colossalai {

namespace dd = distributed::detail;

std::string distributed::error_text(const std::exception& e) {
  if (auto* ce = dynamic_cast<const c10::Error*>(&e)) {
    return ce->what_without_backtrace();
  }
  return e.what();
}

namespace {

// A rank started by `colossalai run` gets SIGTERM when its launcher dies
// (PR_SET_PDEATHSIG). Unless the program handles SIGTERM itself, this
// handler says so when the parent it started under is gone, then dies of
// the signal as it would have. The program asks for the same signal when
// its own parent dies, so a wrapper between it and the launcher (a shell)
// does not leave it running. Only async-signal-safe calls in the handler.
// The message goes to the launcher's stderr (its console or log), which
// the rank holds a copy of: its own stderr is a pipe nobody reads anymore.
pid_t g_parent_pid = 0;
int g_console_fd = STDERR_FILENO;
char g_parent_gone[200] = {0};

void on_term(int sig) {
  if (g_parent_pid != 0 && ::getppid() != g_parent_pid) {
    (void)!::write(g_console_fd, g_parent_gone, std::strlen(g_parent_gone));
  }
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

void report_launcher_death(int rank) {
  const auto launcher = utils::env_str("COLOSSALAI_LAUNCHER_PID");
  if (!launcher) {
    return;
  }
  ::prctl(PR_SET_PDEATHSIG, SIGTERM);
  g_parent_pid = ::getppid();
  if (const auto fd = utils::env_str("COLOSSALAI_LAUNCHER_STDERR_FD")) {
    const int n = std::atoi(fd->c_str());
    if (n > STDERR_FILENO && ::fcntl(n, F_GETFD) != -1) {
      ::fcntl(n, F_SETFD, FD_CLOEXEC); // not for the rank's own children
      g_console_fd = n;
    }
  }
  struct sigaction current {};
  ::sigaction(SIGTERM, nullptr, &current);
  if (current.sa_handler != SIG_DFL) {
    return; // the program's own handling stands
  }
  std::snprintf(
      g_parent_gone,
      sizeof(g_parent_gone),
      "colossalai: rank %d: the launcher (pid %s) is gone (this rank's "
      "parent, pid %ld, exited); this rank stops\n",
      rank,
      launcher->c_str(),
      static_cast<long>(g_parent_pid));
  struct sigaction sa {};
  sa.sa_handler = on_term;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGTERM, &sa, nullptr);
  if (g_parent_pid == 1) {
    ::raise(SIGTERM); // adopted by init: the parent went before prctl
  }
}

bool is_loopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

// Waits (until `deadline`) for something to listen at host:port, probing
// every 10 ms. c10d's TCPStore client sleeps a whole second after each
// refused connection, and workers usually start before rank 0 listens: that
// second was most of a short job's start. The probe connects and closes at
// once, as any client leaving does. Returns early on any other failure: the
// store's client then reports it.
void wait_for_listener(
    const std::string& host,
    int port,
    std::chrono::steady_clock::time_point deadline) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(
          host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) {
    return;
  }
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> owner(
      found, &::freeaddrinfo);
  for (;;) {
    for (auto* a = found; a != nullptr; a = a->ai_next) {
      const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, 0);
      if (fd < 0) {
        return;
      }
      const int rc = ::connect(fd, a->ai_addr, a->ai_addrlen);
      const int err = errno;
      ::close(fd);
      if (rc == 0) {
        return;
      }
      if (err != ECONNREFUSED) {
        return; // unreachable, or slow to answer: not ours to judge
      }
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

} // namespace

void launch(const LaunchOptions& o) {
  record_uncaught_exceptions();
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

  std::string device = o.device();
  if (device == "auto") {
    device = utils::env_str("COLOSSALAI_DEVICE").value_or("auto");
  }
  TORCH_CHECK(
      device == "auto" || device == "cpu" || device == "cuda",
      "colossalai::launch: device must be 'auto', 'cpu' or 'cuda', got '",
      device,
      "' (LaunchOptions::device or COLOSSALAI_DEVICE)");
  const bool cuda = torch::cuda::is_available();
  TORCH_CHECK(
      device != "cuda" || cuda,
      "colossalai::launch: device 'cuda' needs a CUDA device, and this "
      "process sees none (a CPU-only LibTorch, or no GPU visible)");
  bool nccl = o.backend() == "nccl" ||
      (o.backend() == "auto" && cuda && device != "cpu");
#ifndef COLOSSALAI_WITH_CUDA
  TORCH_CHECK(
      !(nccl && o.backend() == "nccl"),
      "colossalai::launch: backend 'nccl' needs a LibTorch with CUDA; this "
      "build has none (use backend 'gloo')");
  nccl = false;
#endif
  TORCH_CHECK(
      !nccl || cuda, "colossalai::launch: backend 'nccl' needs a CUDA device");
  TORCH_CHECK(
      !(nccl && device == "cpu"),
      "colossalai::launch: backend 'nccl' moves CUDA tensors only; device "
      "'cpu' needs backend 'gloo'");
  const bool on_cuda = nccl || device == "cuda";
  int cuda_index = -1;
  if (on_cuda) {
    const int count = static_cast<int>(torch::cuda::device_count());
    cuda_index = (o.local_rank() >= 0 ? o.local_rank() : o.rank()) % count;
    compat::set_cuda_device(cuda_index);
  }
  if (nccl) {
    compat::catchable_nccl_failures();
  }

  // Gloo writes to sockets whose peer may have died: make that an error
  // (EPIPE, turned into a DistributedError) instead of a silent SIGPIPE
  // death, as Python does for every process.
  ::signal(SIGPIPE, SIG_IGN);
  report_launcher_death(o.rank());

  // NOTE [Bounded rendezvous]
  // c10d's TCPStore client waits for the master's replies with no deadline (a
  // listener that accepts and never answers blocks it forever), and rank 0
  // waits for the workers and then again for Gloo's connections, each for
  // the whole timeout. So the rendezvous runs on a helper thread, filling a
  // staging runtime, and the caller waits for it at most `timeout`: then it
  // gets a DistributedError naming its rank, the master and the phase
  // reached. An abandoned helper holds only its own state and ends when its
  // sockets close or time out.
  auto staging = std::make_shared<dd::Runtime>();
  staging->rank = o.rank();
  staging->world_size = o.world_size();
  staging->timeout = o.timeout();
  staging->host = o.host();
  staging->shm_collectives = o.shm_collectives() &&
      utils::env_int("COLOSSALAI_SHM_COLLECTIVES").value_or(1) != 0;
  {
    int64_t mb = o.shm_budget_mb();
    if (mb < 0) {
      mb = utils::env_int("COLOSSALAI_SHM_BUDGET_MB").value_or(-1);
    }
    staging->shm_budget =
        mb >= 0 ? mb << 20 : dd::ShmChannel::default_budget_bytes();
  }
  staging->log_transports =
      utils::env_int("COLOSSALAI_LOG_TRANSPORTS").value_or(1) != 0;
  staging->backend =
      nccl ? distributed::BackendType::kNccl : distributed::BackendType::kGloo;
  if (on_cuda) {
    staging->device =
        c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(cuda_index));
  }
  static const char* const kPhases[] = {
      "starting the rendezvous store",
      "connecting to the master's store",
      "waiting for every rank to reach the store",
      "connecting to the other ranks (process group 'world')",
      "the first barrier",
  };
  // torchrun's agent serving the store: every rank is its client (NOTE
  // [torchrun's agent store] in distributed/tcp_store_client.h).
  const bool agent_store = utils::agent_store_serves(o.host(), o.port());
  const bool serves = o.rank() == 0 && !agent_store;
  auto phase = std::make_shared<std::atomic<int>>(serves ? 0 : 1);
  const std::string where = "rank " + std::to_string(o.rank()) + " of " +
      std::to_string(o.world_size()) + ": rendezvous at " + o.host() + ":" +
      std::to_string(o.port()) + (agent_store ? " (torchrun's store)" : "");
  auto done = std::make_shared<std::promise<void>>();
  auto finished = done->get_future();
  std::thread([staging, phase, done, o, where, cuda_index, serves,
               agent_store]() {
    try {
      if (cuda_index >= 0) {
        // The current device is per thread; NCCL's first barrier runs here.
        compat::set_cuda_device(cuda_index);
      }
      c10::intrusive_ptr<::c10d::Store> store;
      try {
        if (!serves) {
          wait_for_listener(
              o.host(),
              o.port(),
              std::chrono::steady_clock::now() + o.timeout());
        }
        if (agent_store) {
          store = c10::make_intrusive<dd::TcpStoreClient>(
              o.host(), o.port(), o.timeout());
        } else {
          auto tcp = compat::make_tcp_store(
              o.host(),
              static_cast<std::uint16_t>(o.port()),
              /*is_server=*/serves,
              static_cast<std::size_t>(o.world_size()),
              o.timeout());
          *phase = 2;
          tcp->waitForWorkers();
          store = tcp;
        }
      } catch (const std::exception& e) {
        const std::string text = distributed::error_text(e);
        if (*phase == 0) {
          // The port is taken or the address is not ours: no peer to blame.
          throw distributed::DistributedError(
              where +
              ": cannot start the rendezvous store (is another job "
              "using port " +
              std::to_string(o.port()) +
              "? choose another master port): " + text);
        }
        throw distributed::DistributedError(
            where + " failed while " + kPhases[phase->load()] + " (within " +
            std::to_string(o.timeout().count()) + " ms; is the master " +
            "reachable and every rank started?): " + text);
      }
      staging->store = store;
      if (staging->backend == distributed::BackendType::kGloo) {
        if (auto ifname = utils::gloo_socket_ifname()) {
          staging->gloo_device =
              ::c10d::ProcessGroupGloo::createDeviceForInterface(*ifname);
        } else if (is_loopback(o.host())) {
          staging->gloo_device =
              ::c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
        } else {
          staging->gloo_device =
              ::c10d::ProcessGroupGloo::createDefaultDevice();
        }
      }
      *phase = 3;
      std::vector<int> all(o.world_size());
      for (int r = 0; r < o.world_size(); ++r) {
        all[r] = r;
      }
      staging->initialized = true;
      staging->world = dd::create_group(*staging, all, "world");
      // Nobody leaves the rendezvous before everyone has connected: a fast
      // rank that exits early would otherwise break a slow rank's mesh setup.
      *phase = 4;
      distributed::barrier(*staging->world).wait();
      done->set_value();
    } catch (...) {
      done->set_exception(std::current_exception());
    }
  }).detach();
  if (finished.wait_for(o.timeout()) != std::future_status::ready) {
    const int reached = phase->load();
    const std::string n = std::to_string(o.world_size());
    std::string hint;
    if (reached >= 3) {
      hint =
          "is every rank started and reachable from this host (firewall, "
          "GLOO_SOCKET_IFNAME)?";
    } else if (serves) {
      hint = "are all " + n +
          " ranks started, with this master address and "
          "port?";
    } else if (reached == 1) {
      hint = "is the master started and reachable?";
    } else {
      hint = "are all " + n +
          " ranks started, and is that port the master's "
          "rendezvous store (one that accepts and never answers is not)?";
    }
    throw distributed::DistributedError(
        where + " did not complete within " +
        std::to_string(o.timeout().count()) + " ms, stuck " + kPhases[reached] +
        ": " + hint);
  }
  finished.get(); // rethrows the helper's error

  rt.rank = staging->rank;
  rt.world_size = staging->world_size;
  rt.timeout = staging->timeout;
  rt.host = staging->host;
  rt.backend = staging->backend;
  rt.shm_collectives = staging->shm_collectives;
  rt.shm_budget = staging->shm_budget;
  rt.log_transports = staging->log_transports;
  rt.device = staging->device;
  rt.store = staging->store;
  rt.gloo_device = staging->gloo_device;
  rt.world = staging->world;
  rt.group_name_uses = staging->group_name_uses;
  rt.groups = staging->groups;
  rt.initialized = true;
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
  if (env.source == "torchrun") {
    TORCH_CHECK(
        env.master_addr || env.world_size == 1,
        "launch_from_env (torchrun): MASTER_ADDR is not set");
    TORCH_CHECK(
        env.master_port || env.world_size == 1,
        "launch_from_env (torchrun): MASTER_PORT is not set");
  } else if (!env.master_addr && *env.world_size > 1) {
    // OpenMPI and Slurm name no rendezvous address. On one host it can only
    // be this one (base's host and port: 127.0.0.1:29500 by default, or
    // MASTER_PORT); across hosts only the user knows rank 0's.
    const bool one_host =
        (env.local_world_size && *env.local_world_size == *env.world_size) ||
        (env.num_nodes && *env.num_nodes == 1);
    TORCH_CHECK(
        one_host,
        "launch_from_env (",
        env.source,
        "): MASTER_ADDR is not set, and ",
        env.source == "openmpi" ? "OpenMPI" : "Slurm",
        " gives no rendezvous address for ranks on several hosts: export "
        "MASTER_ADDR (rank 0's host) and MASTER_PORT to every rank (",
        env.source == "openmpi"
            ? "mpirun -x MASTER_ADDR=<host> -x MASTER_PORT=<port> ..."
            : "MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" "
              "| head -n 1) before srun",
        ")");
  }
  if (env.master_addr) {
    base.host(*env.master_addr);
  }
  if (env.master_port) {
    base.port(*env.master_port);
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
  rt.groups.clear();
  rt.initialized = false;
}

int restart_count() {
  return utils::read_dist_env().restart_count;
}

c10::Device current_device() {
  return dd::runtime().device;
}

} // namespace colossalai
