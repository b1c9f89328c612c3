// `colossalai run`'s command line: the options (CLI11), parsing them into
// RunOptions, and checking them.

#include <colossalai/launcher.h>

#include "launcher_internal.h"

#include <CLI/CLI.hpp>

#include <c10/util/Exception.h>

#include <algorithm>
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
  if (o.min_nodes > 0) {
    TORCH_CHECK(
        o.min_nodes <= o.nnodes,
        "--nnodes MIN:MAX needs MIN <= MAX, got ",
        o.min_nodes,
        ":",
        o.nnodes);
    TORCH_CHECK(
        o.node_rank == 0,
        "--node_rank is given by the rendezvous under --nnodes MIN:MAX; "
        "leave it out");
    // Bounded so that the milliseconds stay far inside int64 (NaN fails).
    constexpr double kMaxSeconds = 1e7;
    TORCH_CHECK(
        o.rdzv_last_call_timeout >= 0 && o.rdzv_join_timeout > 0 &&
            o.rdzv_last_call_timeout <= kMaxSeconds &&
            o.rdzv_join_timeout <= kMaxSeconds,
        "--rdzv_conf: last_call_timeout must be in [0, 1e7] and join_timeout "
        "in (0, 1e7] seconds, got ",
        o.rdzv_last_call_timeout,
        " and ",
        o.rdzv_join_timeout);
    TORCH_CHECK(
        !o.rdzv_id.empty() &&
            o.rdzv_id.find_first_of("/ \t\n") == std::string::npos,
        "--rdzv_id must be a non-empty name without '/' or spaces, got '",
        o.rdzv_id,
        "'");
    if (!o.rdzv_endpoint.empty()) {
      const auto colon = o.rdzv_endpoint.rfind(':');
      const std::string port =
          colon == std::string::npos ? "" : o.rdzv_endpoint.substr(colon + 1);
      TORCH_CHECK(
          colon != std::string::npos && colon > 0 && !port.empty() &&
              port.size() <= 5 &&
              port.find_first_not_of("0123456789") == std::string::npos &&
              std::stoi(port) >= 1 && std::stoi(port) <= 65535,
          "--rdzv_endpoint must be HOST:PORT with PORT in [1, 65535], got '",
          o.rdzv_endpoint,
          "'");
    }
  }
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

// "N" (a fixed job) or "MIN:MAX" (elastic), as torchrun's --nnodes.
void parse_nnodes(const std::string& v, RunOptions& o) {
  auto number = [&v](const std::string& part) {
    TORCH_CHECK(
        !part.empty() && part.size() <= 9 &&
            part.find_first_not_of("0123456789") == std::string::npos,
        "--nnodes must be N or MIN:MAX, got '",
        v,
        "'");
    return std::stoi(part);
  };
  const auto colon = v.find(':');
  if (colon == std::string::npos) {
    o.nnodes = number(v);
  } else {
    o.min_nodes = number(v.substr(0, colon));
    o.nnodes = number(v.substr(colon + 1));
    TORCH_CHECK(o.min_nodes >= 1, "--nnodes MIN:MAX needs MIN >= 1, got '", v, "'");
  }
}

// torchrun's --rdzv_conf: KEY=VALUE pairs separated by commas.
void parse_rdzv_conf(const std::string& v, RunOptions& o) {
  size_t at = 0;
  while (at <= v.size()) {
    const auto end = std::min(v.find(',', at), v.size());
    const std::string pair = v.substr(at, end - at);
    at = end + 1;
    if (pair.empty()) {
      continue;
    }
    const auto eq = pair.find('=');
    const std::string name = pair.substr(0, eq);
    TORCH_CHECK(
        eq != std::string::npos &&
            (name == "last_call_timeout" || name == "join_timeout"),
        "--rdzv_conf takes last_call_timeout=S and join_timeout=S, got '",
        pair,
        "'");
    double seconds = 0;
    try {
      size_t used = 0;
      seconds = std::stod(pair.substr(eq + 1), &used);
      TORCH_CHECK(used == pair.size() - eq - 1, "");
    } catch (const std::exception&) {
      TORCH_CHECK(false, "--rdzv_conf: '", pair, "' needs a number of seconds");
    }
    (name == "join_timeout" ? o.rdzv_join_timeout : o.rdzv_last_call_timeout) =
        seconds;
  }
}

// The options of `colossalai run`, bound to `o`. torchrun's grammar:
// launcher options, then PROGRAM and its own arguments, untouched
// (prefix_command stops at the first argument that is not ours).
std::unique_ptr<CLI::App> run_app(RunOptions& o) {
  auto app = std::make_unique<CLI::App>(
      "Starts N local ranks of PROGRAM with torchrun's environment (RANK,\n"
      "WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,\n"
      "MASTER_PORT). When a rank fails, the others are stopped and its exit\n"
      "code is returned (128 + signal when it was killed by a signal).\n"
      "--nnodes MIN:MAX makes the job elastic: it runs on the nodes present\n"
      "and re-forms when one fails, leaves or arrives (with --max_restarts).",
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
  app->add_option_function<std::string>(
         "--nnodes",
         [&o](const std::string& v) { parse_nnodes(v, o); },
         "number of nodes, or MIN:MAX for an elastic job")
      ->default_str("1");
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
  app->add_option_function<std::string>(
      "--rdzv_backend,--rdzv-backend",
      [&o](const std::string& v) {
        TORCH_CHECK(
            v == "static" || v == "c10d",
            "--rdzv_backend must be 'static' or 'c10d', got '",
            v,
            "'");
        if (v == "c10d" && o.min_nodes == 0) {
          o.min_nodes = -1; // elastic at a fixed size, once --nnodes is read
        }
      },
      "c10d: the elastic rendezvous (implied by --nnodes MIN:MAX)");
  app->add_option(
      "--rdzv_endpoint,--rdzv-endpoint",
      o.rdzv_endpoint,
      "elastic rendezvous store HOST:PORT (default: master_addr:master_port)");
  app->add_option("--rdzv_id,--rdzv-id", o.rdzv_id, "the job's name in that store")
      ->capture_default_str();
  app->add_option_function<std::string>(
      "--rdzv_conf,--rdzv-conf",
      [&o](const std::string& v) { parse_rdzv_conf(v, o); },
      "last_call_timeout=S,join_timeout=S (seconds; 30 and 600)");
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
  if (o.min_nodes < 0) {
    o.min_nodes = o.nnodes; // --rdzv_backend c10d with a fixed --nnodes
  }
  validate(o);
  return o;
}

} // namespace launcher
} // namespace colossalai
