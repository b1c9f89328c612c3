// Files exchanged with Python's torch: Python reads our safetensors (with a
// reader written from the spec) and .bin files (torch.load), and writes files
// of its own that we read back. Needs /usr/bin/python3 with torch.

#include <colossalai/checkpoint_io/safetensors.h>
#include <colossalai/checkpoint_io/torch_bin.h>

#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
namespace st = colossalai::checkpoint_io::safetensors;
using colossalai::checkpoint_io::StateDict;

constexpr const char* kPython = "/usr/bin/python3";

/// The tensors both sides write; `expected()` in tests/python/interop.py
/// builds the same.
StateDict expected() {
  StateDict sd;
  sd.insert("f32", at::arange(12, at::kFloat).reshape({3, 4}) / 4 - 1);
  sd.insert("bf16", ((at::arange(10) - 5) * 0.5).to(at::kBFloat16));
  sd.insert(
      "i64", at::arange(6, at::kLong).reshape({2, 3}) * (int64_t(1) << 40) - 3);
  sd.insert("f16", ((at::arange(8) - 4) / 8).to(at::kHalf).reshape({2, 2, 2}));
  sd.insert("bool", at::arange(5).remainder(2) == 0);
  sd.insert("scalar", at::scalar_tensor(3.25, at::kDouble));
  return sd;
}

std::string quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  }
  return out + "'";
}

/// Runs `command` through the shell; returns its exit status and output.
std::pair<int, std::string> run(const std::string& command) {
  std::string output;
  FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) {
    return {-1, "popen failed"};
  }
  char buf[4096];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof(buf), pipe)) > 0) {
    output.append(buf, n);
  }
  int status = ::pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, output};
}

bool python_has_torch() {
  return ::access(kPython, X_OK) == 0 &&
      run(std::string(kPython) + " -c 'import torch'").first == 0;
}

void expect_tensor(
    const std::string& what,
    const at::Tensor& want,
    const at::Tensor* got) {
  ASSERT_NE(got, nullptr) << what << " is missing";
  EXPECT_EQ(got->scalar_type(), want.scalar_type()) << what;
  EXPECT_EQ(got->sizes(), want.sizes()) << what;
  EXPECT_TRUE(got->equal(want)) << what << ": " << *got << " vs " << want;
}

TEST(InteropPython, ExchangesFilesWithPythonTorch) {
  if (!python_has_torch()) {
    GTEST_SKIP() << "Python torch absent: install python3-torch";
  }
  // The script sits beside this source file.
  const fs::path script =
      fs::path(__FILE__).parent_path() / "python" / "interop.py";
  ASSERT_TRUE(fs::exists(script)) << script;

  std::string pattern = (fs::temp_directory_path() / "interop_XXXXXX").string();
  ASSERT_NE(::mkdtemp(&pattern[0]), nullptr);
  const fs::path dir = pattern;
  struct Cleanup {
    fs::path dir;
    ~Cleanup() {
      std::error_code ec;
      fs::remove_all(dir, ec);
    }
  } cleanup{dir};

  const StateDict want = expected();
  st::save_file(
      (dir / "cpp.safetensors").string(), want, {{"writer", "colossalai"}});
  colossalai::checkpoint_io::save_bin((dir / "cpp.bin").string(), want);

  const auto result =
      run(std::string(kPython) + " " + quote(script.string()) + " check " +
          quote(dir.string()));
  ASSERT_EQ(result.first, 0) << "interop.py failed:\n" << result.second;

  auto file = st::MappedFile::open((dir / "py.safetensors").string());
  EXPECT_EQ(file->header().metadata.at("writer"), "python");
  const StateDict from_st = file->tensors();
  EXPECT_EQ(from_st.size(), want.size());
  for (const auto& item : want) {
    expect_tensor(
        "py.safetensors:" + item.key(), item.value(), from_st.find(item.key()));
  }

  const StateDict from_bin =
      colossalai::checkpoint_io::load_bin((dir / "py.bin").string());
  std::vector<std::string> keys = want.keys();
  keys.push_back("f32_t");
  EXPECT_EQ(from_bin.keys(), keys);
  for (const auto& item : want) {
    expect_tensor(
        "py.bin:" + item.key(), item.value(), from_bin.find(item.key()));
  }
  expect_tensor("py.bin:f32_t", want["f32"].t(), from_bin.find("f32_t"));
  EXPECT_TRUE(from_bin["f32_t"].is_alias_of(from_bin["f32"]));

  const StateDict one =
      colossalai::checkpoint_io::load_bin((dir / "py_one.bin").string());
  ASSERT_EQ(one.keys(), std::vector<std::string>{"only"});
  expect_tensor("py_one.bin:only", at::arange(3), one.find("only"));
}

} // namespace
