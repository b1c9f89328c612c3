// libFuzzer target for models::Tokenizer's readers of untrusted files
// (build and run with fuzz/run.sh tokenizer). Each input is
//  - read as a SentencePiece tokenizer.model (our protobuf reader): it must
//    load or throw std::runtime_error naming the file; one that loads
//    encodes and decodes the input itself as text;
//  - normalized to NFC, which must be idempotent on valid UTF-8.
// Anything else (a crash, a sanitizer report, another exception) is a
// finding.

#include <colossalai/models/tokenizer.h>

#include "../src/models/tokenizer_internal.h"

#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>

namespace td = colossalai::models::tokenizer_detail;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);

  const auto once = td::nfc(bytes);
  const auto u = td::decode_utf8(bytes);
  bool valid = true;
  for (const uint32_t cp : u.cp) {
    valid = valid && cp != 0xFFFFFFFFu;
  }
  if (valid && td::nfc(once) != once) {
    std::abort(); // NFC(NFC(x)) != NFC(x)
  }

  static const std::string dir =
      "/tmp/colossalai_tokenizer_fuzz." + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  {
    std::ofstream out(dir + "/tokenizer.model", std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  try {
    const auto tok = colossalai::models::Tokenizer::from_pretrained(dir);
    const auto ids = tok.encode(bytes, /*add_special_tokens=*/true);
    volatile size_t sink = tok.decode(ids).size();
    (void)sink;
  } catch (const std::runtime_error&) {
    // A malformed or unsupported model, named: expected.
  }
  return 0;
}
