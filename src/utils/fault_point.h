#pragma once

// Deterministic crash points for fault-injection tests (internal).
//
// NOTE [Fault points]
// Code that must survive a crash at any step (checkpoint commits) marks each
// step with fault_point("name"). When the environment variable
// COLOSSALAI_FAULT_POINT is "name" or "name#k", the process kills itself with
// SIGKILL the first (or k-th) time it reaches that point, exactly as a power
// cut or an OOM kill would stop it: no destructor, no flush. A suffix "@TERM"
// ("name#k@TERM") sends SIGTERM instead, as a launcher tearing a job down
// does. Unset, a fault point costs one cached comparison.

namespace colossalai {
namespace utils {

void fault_point(const char* name);

} // namespace utils
} // namespace colossalai
