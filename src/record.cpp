#include <colossalai/record.h>

#include <colossalai/utils/env.h>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <cxxabi.h>

#include <atomic>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <iostream>
#include <memory>
#include <mutex>
#include <string>
#include <typeinfo>

namespace colossalai {

namespace {

std::atomic<bool> g_recorded{false};
std::terminate_handler g_previous_terminate = nullptr;

std::string type_name(const std::type_info& type) {
  int status = 0;
  std::unique_ptr<char, decltype(&std::free)> name(
      abi::__cxa_demangle(type.name(), nullptr, nullptr, &status), &std::free);
  return status == 0 && name ? std::string(name.get()) : type.name();
}

// Python's pair: "RuntimeError: <message>" and the traceback, here the
// message with the backtrace c10::Error carries (when it carries one).
struct Described {
  std::string message;
  std::string callstack;
};

Described describe(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const c10::Error& e) {
    const std::string type = type_name(typeid(e));
    return {type + ": " + e.what_without_backtrace(), type + ": " + e.what()};
  } catch (const std::exception& e) {
    const std::string text = type_name(typeid(e)) + ": " + e.what();
    return {text, text};
  } catch (...) {
    return {"unknown exception", "unknown exception (not a std::exception)"};
  }
}

void on_terminate() {
  if (auto error = std::current_exception()) {
    if (!g_recorded.load()) {
      try {
        record_exception(error);
      } catch (...) {
        // Terminating already: the previous handler still runs.
      }
    }
  }
  (g_previous_terminate != nullptr ? g_previous_terminate : &std::abort)();
}

} // namespace

bool record_exception(const std::exception_ptr& error) {
  const auto file = utils::torchelastic_error_file();
  if (!file || !error) {
    return false;
  }
  const Described d = describe(error);
  const nlohmann::json data = {
      {"message",
       {{"message", d.message},
        {"extraInfo",
         {{"py_callstack", d.callstack},
          {"timestamp", std::to_string(std::time(nullptr))}}}}}};
  // ensure_ascii as Python's json.dump; bytes that are not UTF-8 (a path in
  // a message) are replaced rather than failing the report.
  const std::string text =
      data.dump(-1, ' ', true, nlohmann::json::error_handler_t::replace);
  std::ofstream out(*file, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) {
    std::cerr << "colossalai: cannot write the error file "
              << "TORCHELASTIC_ERROR_FILE='" << *file << "'" << std::endl;
    return false;
  }
  g_recorded = true;
  return true;
}

int record(const std::function<int()>& main_body) {
  try {
    return main_body();
  } catch (...) {
    const auto error = std::current_exception();
    record_exception(error);
    std::cerr << describe(error).message << std::endl;
    return 1;
  }
}

void record_uncaught_exceptions() {
  static std::mutex mutex;
  static bool installed = false;
  std::lock_guard<std::mutex> lock(mutex);
  if (!installed && utils::torchelastic_error_file()) {
    g_previous_terminate = std::set_terminate(&on_terminate);
    installed = true;
  }
}

} // namespace colossalai
