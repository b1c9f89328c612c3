// `colossalai run`'s command line: the options (CLI11), parsing them into
// RunOptions, and checking them.

#include <colossalai/launcher.h>

#include "launcher_internal.h"

#include <CLI/CLI.hpp>

#include <c10/util/Exception.h>

#include <climits>
#include <memory>
#include <string>
#include <vector>

namespace colossalai {
namespace launcher {
namespace detail {

void validate(const RunOptions& o) {
  TORCH_CHECK(
      o.nproc_per_node >= 1,
      "--nproc_per_node must be >= 1, got ",
      o.nproc_per_node);
  TORCH_CHECK(o.nnodes >= 1, "--nnodes must be >= 1, got ", o.nnodes);
  TORCH_CHECK(
      o.node_rank >= 0 && o.node_rank < o.nnodes,
      "--node_rank must be in [0, --nnodes=",
      o.nnodes,
      "), got ",
      o.node_rank);
  TORCH_CHECK(
      o.master_port >= 1 && o.master_port <= 65535,
      "--master_port must be in [1, 65535], got ",
      o.master_port);
  TORCH_CHECK(!o.master_addr.empty(), "--master_addr must not be empty");
  TORCH_CHECK(
      o.kill_grace_seconds >= 0,
      "--kill_grace_seconds must be >= 0, got ",
      o.kill_grace_seconds);
  TORCH_CHECK(
      o.max_restarts >= 0, "--max_restarts must be >= 0, got ", o.max_restarts);
  TORCH_CHECK(
      static_cast<long long>(o.nnodes) * o.nproc_per_node <= INT_MAX,
      "--nnodes * --nproc_per_node is too large");
  TORCH_CHECK(
      !o.program.empty() && !o.program[0].empty(),
      "no program given (usage: colossalai run [options] PROGRAM [ARGS...])");
}

} // namespace detail

using detail::validate;

namespace {

// The options of `colossalai run`, bound to `o`. torchrun's grammar:
// launcher options, then PROGRAM and its own arguments, untouched
// (prefix_command stops at the first argument that is not ours).
std::unique_ptr<CLI::App> run_app(RunOptions& o) {
  auto app = std::make_unique<CLI::App>(
      "Starts N local ranks of PROGRAM with torchrun's environment (RANK,\n"
      "WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,\n"
      "MASTER_PORT). When a rank fails, the others are stopped and its exit\n"
      "code is returned (128 + signal when it was killed by a signal).",
      "colossalai run");
  app->footer(
      "PROGRAM and its ARGS follow the options (after '--' when PROGRAM\n"
      "starts with '-'); options also take the form --opt=value.");
  app->set_help_flag("-h,--help", "show this help");
  // "--nproc-per-node" is accepted for "--nproc_per_node", as in torchrun.
  app->add_option(
         "--nproc_per_node,--nproc-per-node",
         o.nproc_per_node,
         "ranks on this node")
      ->required();
  app->add_option("--nnodes", o.nnodes, "number of nodes")
      ->capture_default_str();
  app->add_option(
         "--node_rank,--node-rank", o.node_rank, "this node's index in [0, M)")
      ->capture_default_str();
  app->add_option("--master_addr,--master-addr", o.master_addr, "rank 0's host")
      ->capture_default_str();
  app->add_option("--master_port,--master-port", o.master_port, "rank 0's port")
      ->capture_default_str();
  app->add_option(
      "--log_dir,--log-dir",
      o.log_dir,
      "also write rank r's output to DIR/rank_<r>.log");
  app->add_flag_function(
         "--no_prefix,--no-prefix",
         [&o](int64_t) { o.prefix_output = false; },
         "do not prefix output lines with \"[rank r] \"")
      ->disable_flag_override();
  app->add_option(
         "--kill_grace_seconds,--kill-grace-seconds",
         o.kill_grace_seconds,
         "after a failure, seconds between SIGTERM and SIGKILL")
      ->capture_default_str();
  app->add_option(
         "--max_restarts,--max-restarts",
         o.max_restarts,
         "restart all local ranks up to N times after a failure")
      ->capture_default_str();
  app->prefix_command();
  return app;
}

} // namespace

std::string run_usage() {
  RunOptions o;
  return run_app(o)->help();
}

RunOptions parse_run_args(const std::vector<std::string>& args) {
  RunOptions o;
  for (const auto& a : args) {
    if (a == "--") {
      break;
    }
    // CLI11 would take the next argument as the value of "--opt=".
    TORCH_CHECK(
        !(a.size() > 3 && a.compare(0, 2, "--") == 0 && a.back() == '='),
        a.substr(0, a.size() - 1),
        " needs a value (got '",
        a,
        "')");
  }
  auto app = run_app(o);
  try {
    std::vector<std::string> reversed(args.rbegin(), args.rend());
    app->parse(reversed);
  } catch (const CLI::CallForHelp&) {
    o.help = true;
    return o;
  } catch (const CLI::ParseError& e) {
    TORCH_CHECK(false, e.what());
  }
  auto rest = app->remaining();
  if (!rest.empty() && rest.front() == "--") {
    rest.erase(rest.begin()); // what follows is the program, dashes or not
  } else if (
      !rest.empty() && rest.front().size() > 1 && rest.front()[0] == '-') {
    TORCH_CHECK(
        false,
        "unknown option '",
        rest.front().substr(0, rest.front().find('=')),
        "'");
  }
  o.program = std::move(rest);
  validate(o);
  return o;
}

} // namespace launcher
} // namespace colossalai
