#pragma once

// Small helpers shared by the tests.

#include <functional>
#include <string>

namespace colossalai {
namespace testing {

/// The message `fn` throws (error_text of the exception), or "" if it
/// returns.
std::string error_of(const std::function<void()>& fn);

/// A fresh directory under the system's temporary directory, named after
/// `prefix`, this process and the time.
std::string temp_dir(const std::string& prefix);

/// The ranks' shared scratch directory of a multi-process test, named after
/// `what` and the parent test process (the ranks are its children: pass
/// getppid() there); `remove_scratch` in the parent removes it.
std::string scratch(int parent, const std::string& what);
void remove_scratch(const std::string& what);

} // namespace testing
} // namespace colossalai
