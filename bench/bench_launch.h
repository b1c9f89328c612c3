#pragma once

// The main() tail of the multi-rank benchmarks: started by hand, a program
// launches `nproc` copies of itself (launcher::run_self); launched, it runs
// its rank. An exception prints its text and exits 1.

#include <colossalai/distributed/error.h>
#include <colossalai/launcher.h>

#include <exception>
#include <functional>
#include <iostream>

namespace colossalai {
namespace bench {

inline int launch_ranks(
    int nproc,
    int argc,
    char** argv,
    const std::function<int()>& run_rank) {
  try {
    if (!launcher::launched_by_launcher()) {
      return launcher::run_self(nproc, argc, argv);
    }
    return run_rank();
  } catch (const std::exception& e) {
    std::cerr << "error: " << distributed::error_text(e) << std::endl;
    return 1;
  }
}

} // namespace bench
} // namespace colossalai
