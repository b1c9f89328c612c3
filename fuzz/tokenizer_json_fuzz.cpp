// libFuzzer target for models::Tokenizer's reader of tokenizer.json and
// tokenizer_config.json (build and run with fuzz/run.sh tokenizer_json).
// Each input is a tokenizer.json, optionally followed by "\n---\n" and a
// tokenizer_config.json. It must load or throw an exception derived from
// std::exception (a named, malformed or unsupported file); one that loads
// encodes a text with its added tokens and whitespace around them, and the
// input itself, and decodes the ids. Anything else (a crash, a sanitizer
// report, a hang, another exception type) is a finding.

#include <colossalai/models/tokenizer.h>

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <string>

namespace {

void write(const std::string& path, const std::string& bytes) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) {
    std::abort();
  }
  std::fwrite(bytes.data(), 1, bytes.size(), f);
  std::fclose(f);
}

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  static const std::string dir =
      "/tmp/colossalai_tokenizer_json_fuzz." + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  const auto cut = input.find("\n---\n");
  write(dir + "/tokenizer.json", input.substr(0, cut));
  if (cut != std::string::npos) {
    write(dir + "/tokenizer_config.json", input.substr(cut + 5));
  } else {
    std::filesystem::remove(dir + "/tokenizer_config.json");
  }
  try {
    const auto tok = colossalai::models::Tokenizer::from_pretrained(dir);
    const std::string text =
        "Hello  <mask>  world<s></s>\n\t 123 caf\xC3\xA9 e\xCC\x81 <|endoftext|>";
    for (const auto& t : {text, input}) {
      const auto ids = tok.encode(t, /*add_special_tokens=*/true);
      volatile size_t sink = tok.decode(ids).size();
      (void)sink;
    }
  } catch (const std::exception&) {
    // Refused with a message: expected.
  }
  return 0;
}
