// `colossalai` command-line tool. Today it has one command, `run`, a
// torchrun-compatible launcher (see colossalai/launcher.h).

#include <colossalai/launcher.h>

#include <c10/util/Exception.h>

#include <exception>
#include <iostream>
#include <string>
#include <vector>

namespace {

constexpr const char* kUsage =
    "usage: colossalai <command> [options]\n"
    "\n"
    "commands:\n"
    "  run    start the local ranks of a distributed program\n"
    "\n"
    "Run 'colossalai run --help' for the options of run.\n";

} // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty()) {
    std::cerr << kUsage;
    return 2;
  }
  const std::string& command = args[0];
  if (command == "-h" || command == "--help" || command == "help") {
    std::cout << kUsage;
    return 0;
  }
  if (command != "run") {
    std::cerr << "colossalai: unknown command '" << command << "'\n" << kUsage;
    return 2;
  }

  namespace launcher = colossalai::launcher;
  launcher::RunOptions options;
  try {
    options = launcher::parse_run_args({args.begin() + 1, args.end()});
  } catch (const c10::Error& e) {
    std::cerr << "colossalai run: " << e.what_without_backtrace() << "\n"
              << "Run 'colossalai run --help' for usage.\n";
    return 2;
  }
  if (options.help) {
    std::cout << launcher::run_usage();
    return 0;
  }
  try {
    return launcher::run(options);
  } catch (const c10::Error& e) {
    std::cerr << "colossalai run: " << e.what_without_backtrace() << "\n";
  } catch (const std::exception& e) {
    std::cerr << "colossalai run: " << e.what() << "\n";
  }
  return 1;
}
