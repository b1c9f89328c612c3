// libFuzzer target for the zip central-directory reader that maps the
// stored records of .bin checkpoints (build and run with fuzz/run.sh zip).
// Each input is written to a file and opened as a checkpoint archive; every
// record it serves is read to its last byte, so the sanitizers see any
// record that claims bytes outside the file. Any input must be served or
// left to miniz (an empty result); anything else is a finding.

#include "../src/checkpoint_io/zip_records.h"

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>

namespace ckd = colossalai::checkpoint_io::detail;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path =
      "/tmp/colossalai_zip_fuzz." + std::to_string(::getpid());
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) {
    return 0;
  }
  std::fwrite(data, 1, size, f);
  std::fclose(f);
  auto records = ckd::ZipRecords::open(path);
  if (records != nullptr) {
    volatile uint8_t sink = 0;
    for (const auto& name : records->names()) {
      c10::Storage s;
      if (records->storage(name, s)) {
        const auto* bytes = static_cast<const uint8_t*>(s.data());
        for (size_t i = 0; i < s.nbytes(); ++i) {
          sink = sink ^ bytes[i];
        }
      }
    }
  }
  std::remove(path.c_str());
  return 0;
}
