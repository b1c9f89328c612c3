#pragma once

/// Reporting a worker's error to torchrun, as Python's
/// `torch.distributed.elastic.multiprocessing.errors.record` does: torchrun
/// gives every worker a file to write its error to (TORCHELASTIC_ERROR_FILE)
/// and prints the first failed worker's error as the root cause of the job's
/// failure. Without that file it can only say "exitcode: 1".
///
/// Example:
/// \code
///   int main(int argc, char** argv) {
///     return colossalai::record([&] {
///       colossalai::launch_from_env();
///       // ... train ...
///       return 0;
///     });
///   }
/// \endcode
/// Under `torchrun --no-python --nproc_per_node 2 ./train`, an exception
/// thrown on rank 1 ends that rank with exit code 1 and torchrun's summary
/// shows its type and message (and the C++ backtrace c10::Error carries).
///
/// Without `record`, `launch` still records an exception that escapes main
/// (or any thread) on its way to `std::terminate`: the error file is written,
/// then the previous terminate handler runs (which aborts: the rank ends by
/// SIGABRT instead of exit code 1).

#include <exception>
#include <functional>

namespace colossalai {

/// Runs `main_body` and returns what it returns. An exception it throws is
/// written to torchrun's error file (when TORCHELASTIC_ERROR_FILE is set),
/// printed on stderr as "<type>: <message>" (without c10::Error's backtrace,
/// which the error file keeps), and turned into the return value 1 (the exit
/// code of a Python worker that raised).
int record(const std::function<int()>& main_body);

/// Writes `error` to TORCHELASTIC_ERROR_FILE in the JSON torch's
/// `ErrorHandler.record_exception` writes:
/// `{"message": {"message": "<type>: <what>", "extraInfo": {"py_callstack":
/// <what, with c10::Error's backtrace>, "timestamp": "<seconds since the
/// epoch>"}}}`. Returns false, writing nothing, when the variable is unset
/// or the file cannot be written (said on stderr).
bool record_exception(const std::exception_ptr& error);

/// When TORCHELASTIC_ERROR_FILE is set, makes `std::terminate` record the
/// exception that escaped before the previous terminate handler runs
/// (installed once per process; `launch` calls it). Nothing is recorded when `record` or
/// `record_exception` already recorded an error.
void record_uncaught_exceptions();

} // namespace colossalai
