// safetensors and .bin state-dict files: round trips, files from other
// writers, zero-copy loading, and the errors malformed files raise.

#include <colossalai/checkpoint_io/safetensors.h>
#include <colossalai/checkpoint_io/torch_bin.h>

#include <caffe2/serialize/inline_container.h>
#include <gtest/gtest.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
namespace st = colossalai::checkpoint_io::safetensors;
using colossalai::checkpoint_io::load_bin;
using colossalai::checkpoint_io::save_bin;
using colossalai::checkpoint_io::StateDict;

class TempDir {
 public:
  TempDir() {
    std::string pattern =
        (fs::temp_directory_path() / "st_test_XXXXXX").string();
    std::vector<char> buf(pattern.begin(), pattern.end());
    buf.push_back('\0');
    EXPECT_NE(::mkdtemp(buf.data()), nullptr);
    path_ = buf.data();
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const {
    return (fs::path(path_) / name).string();
  }

 private:
  std::string path_;
};

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) {
    s[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  }
  return s;
}

/// A safetensors file as another writer may lay it out: `json` verbatim,
/// followed by `pad` spaces, then `data`.
std::string safetensors_bytes(
    const std::string& json,
    const std::string& data,
    size_t pad = 0) {
  std::string header = json + std::string(pad, ' ');
  return le64(header.size()) + header + data;
}

std::string repeat(const std::string& s, int n) {
  std::string out;
  for (int i = 0; i < n; ++i) {
    out += s;
  }
  return out;
}

template <typename T>
std::string raw(std::initializer_list<T> values) {
  std::string s(values.size() * sizeof(T), '\0');
  std::memcpy(&s[0], values.begin(), s.size());
  return s;
}

/// Runs `fn`, expecting a c10::Error whose message holds every `parts`.
void expect_error(
    const std::function<void()>& fn,
    const std::vector<std::string>& parts) {
  try {
    fn();
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    for (const auto& part : parts) {
      EXPECT_NE(msg.find(part), std::string::npos)
          << "message lacks \"" << part << "\": " << msg;
    }
    return;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected c10::Error, got: " << e.what();
    return;
  }
  ADD_FAILURE() << "expected an error mentioning \"" << parts.at(0) << "\"";
}

StateDict every_dtype() {
  StateDict sd;
  auto base = at::arange(15, at::kDouble).reshape({3, 5}) - 7;
  sd.insert("f64", base / 3);
  sd.insert("f32", (base / 4).to(at::kFloat));
  sd.insert("f16", (base / 8).to(at::kHalf));
  sd.insert("bf16", (base * 1.5).to(at::kBFloat16));
  sd.insert("i64", (base * (int64_t(1) << 40)).to(at::kLong));
  sd.insert("i32", (base * 100000).to(at::kInt));
  sd.insert("i16", (base * 1000).to(at::kShort));
  sd.insert("i8", base.to(at::kChar));
  sd.insert("u8", (base + 7).to(at::kByte));
  sd.insert("bool", base.remainder(3) == 0);
  return sd;
}

void expect_same(const StateDict& expected, const StateDict& actual) {
  ASSERT_EQ(expected.size(), actual.size());
  for (const auto& item : expected) {
    const at::Tensor* got = actual.find(item.key());
    ASSERT_NE(got, nullptr) << item.key();
    EXPECT_EQ(got->scalar_type(), item.value().scalar_type()) << item.key();
    EXPECT_EQ(got->sizes(), item.value().sizes()) << item.key();
    EXPECT_TRUE(got->cpu().equal(item.value().cpu())) << item.key();
  }
}

std::vector<std::string> keys(const StateDict& sd) {
  return sd.keys();
}

/// Address ranges of this process's mappings of `path`.
std::vector<std::pair<uintptr_t, uintptr_t>> mappings_of(
    const std::string& path) {
  const std::string target = fs::canonical(path).string();
  std::ifstream maps("/proc/self/maps");
  std::vector<std::pair<uintptr_t, uintptr_t>> out;
  std::string line;
  while (std::getline(maps, line)) {
    size_t slash = line.find('/');
    if (slash == std::string::npos || line.substr(slash) != target) {
      continue;
    }
    uintptr_t lo = 0;
    uintptr_t hi = 0;
    std::sscanf(line.c_str(), "%lx-%lx", &lo, &hi);
    out.emplace_back(lo, hi);
  }
  return out;
}

// ---------------------------------------------------------------- safetensors

TEST(Safetensors, RoundTripsEveryDtypeAndMetadata) {
  TempDir dir;
  const auto path = dir.file("all.safetensors");
  const StateDict sd = every_dtype();
  const std::map<std::string, std::string> meta = {
      {"format", "pt"}, {"note", "üñí \"quoted\"\n"}};
  st::save_file(path, sd, meta);

  auto file = st::MappedFile::open(path);
  EXPECT_EQ(file->header().metadata, meta);
  EXPECT_EQ(file->path(), path);
  for (const auto& item : sd) {
    EXPECT_TRUE(file->contains(item.key()));
  }
  EXPECT_FALSE(file->contains("missing"));
  const StateDict loaded = file->tensors();
  expect_same(sd, loaded);
  // File order is the order tensors were given in.
  EXPECT_EQ(keys(loaded), keys(sd));
  expect_same(sd, st::load_file(path));
}

TEST(Safetensors, HeaderIsCompactPaddedAndInGivenOrder) {
  TempDir dir;
  const auto path = dir.file("layout.safetensors");
  StateDict sd;
  sd.insert("zeta", at::ones({3}, at::kFloat));
  sd.insert("alpha", at::ones({1}, at::kByte));
  sd.insert("mid", at::ones({2, 2}, at::kHalf));
  st::save_file(path, sd);

  const std::string bytes = read_bytes(path);
  ASSERT_GE(bytes.size(), 8u);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) {
    n |= static_cast<uint64_t>(static_cast<uint8_t>(bytes[i])) << (8 * i);
  }
  EXPECT_EQ((8 + n) % 64, 0u); // data on a cache line
  EXPECT_EQ(bytes.size(), 8 + n + 12 + 1 + 8);
  const std::string header = bytes.substr(8, n);
  EXPECT_EQ(header[0], '{');
  EXPECT_EQ(header.find(": "), std::string::npos) << header;
  EXPECT_LT(header.find("\"zeta\""), header.find("\"alpha\""));
  EXPECT_LT(header.find("\"alpha\""), header.find("\"mid\""));
  EXPECT_EQ(header.find("__metadata__"), std::string::npos);
  EXPECT_NE(
      header.find(
          "\"zeta\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,12]}"),
      std::string::npos)
      << header;
}

TEST(Safetensors, ZeroSizeAndScalarTensors) {
  TempDir dir;
  const auto path = dir.file("edge.safetensors");
  StateDict sd;
  sd.insert("empty_first", at::zeros({0, 4}));
  sd.insert("scalar", at::scalar_tensor(3.5, at::kDouble));
  sd.insert("empty_mid", at::zeros({0}, at::kBFloat16));
  sd.insert("values", at::arange(5, at::kInt));
  sd.insert("empty_last", at::zeros({2, 0, 3}, at::kBool));
  st::save_file(path, sd);

  const StateDict loaded = st::load_file(path);
  expect_same(sd, loaded);
  EXPECT_EQ(keys(loaded), keys(sd));
  EXPECT_EQ(loaded["scalar"].dim(), 0);
  EXPECT_EQ(loaded["scalar"].item<double>(), 3.5);

  // Only empty tensors: the data section is empty.
  const auto empty_path = dir.file("only_empty.safetensors");
  StateDict empty;
  empty.insert("e", at::zeros({0, 3}));
  st::save_file(empty_path, empty);
  expect_same(empty, st::load_file(empty_path));
  const auto none_path = dir.file("none.safetensors");
  st::save_file(none_path, StateDict{}, {{"k", "v"}});
  EXPECT_TRUE(st::load_file(none_path).is_empty());
  EXPECT_EQ(st::MappedFile::open(none_path)->header().metadata.at("k"), "v");
}

TEST(Safetensors, NonContiguousAndSparseInputs) {
  TempDir dir;
  const auto path = dir.file("views.safetensors");
  const auto base = at::arange(24, at::kFloat).reshape({4, 6});
  StateDict sd;
  sd.insert("transposed", base.t());
  sd.insert("strided", base.slice(1, 0, 6, 2));
  sd.insert("offset", base.select(0, 2));
  sd.insert("expanded", at::arange(3, at::kLong).expand({4, 3}));
  sd.insert("sparse", base.to_sparse());
  st::save_file(path, sd);

  StateDict expected;
  for (const auto& item : sd) {
    expected.insert(item.key(), item.value().to_dense().contiguous());
  }
  expect_same(expected, st::load_file(path));
  EXPECT_EQ(
      fs::file_size(path),
      st::MappedFile::open(path)->header().data_offset +
          (24 + 12 + 6 + 24) * 4 + 12 * 8);
}

TEST(Safetensors, ReadsAnotherWritersFile) {
  TempDir dir;
  // Keys in an order unlike the data's, metadata between them, spaces inside
  // the JSON and a header length that leaves the data unaligned.
  const std::string json =
      "{ \"b\": {\"shape\": [2], \"dtype\": \"I32\", \"data_offsets\": [8, 16]},"
      " \"__metadata__\": {\"format\": \"pt\"},"
      " \"a\": {\"data_offsets\": [0, 8], \"dtype\": \"F32\", \"shape\": [2]},"
      " \"c\": {\"dtype\": \"BOOL\", \"shape\": [1, 3], "
      "\"data_offsets\": [16, 19]}}";
  const std::string data = raw<float>({1.5f, -2.0f}) + raw<int32_t>({7, -9}) +
      std::string("\x01\x00\x01", 3);
  for (size_t pad : {0, 1, 3, 5}) {
    const auto path = dir.file("foreign" + std::to_string(pad));
    write_bytes(path, safetensors_bytes(json, data, pad));
    auto file = st::MappedFile::open(path);
    EXPECT_EQ(file->header().metadata.at("format"), "pt");
    const StateDict sd = file->tensors();
    EXPECT_EQ(keys(sd), (std::vector<std::string>{"a", "b", "c"}));
    EXPECT_TRUE(sd["a"].equal(at::tensor({1.5f, -2.0f})));
    EXPECT_TRUE(sd["b"].equal(at::tensor({7, -9}, at::kInt)));
    EXPECT_TRUE(
        sd["c"].equal(at::tensor({1, 0, 1}).to(at::kBool).reshape({1, 3})));
    // Unaligned data is copied, so kernels always see aligned elements.
    for (const auto& item : sd) {
      EXPECT_EQ(
          reinterpret_cast<uintptr_t>(item.value().data_ptr()) %
              item.value().element_size(),
          0u)
          << item.key();
    }
  }
}

TEST(Safetensors, ParsesHeaderFromMemory) {
  const std::string bytes = safetensors_bytes(
      "{\"x\":{\"dtype\":\"U8\",\"shape\":[2,2],\"data_offsets\":[0,4]}}",
      "abcd");
  const st::Header header = st::parse_header(
      reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "mem");
  ASSERT_EQ(header.tensors.size(), 1u);
  EXPECT_EQ(header.tensors[0].name, "x");
  EXPECT_EQ(header.tensors[0].dtype, at::kByte);
  EXPECT_EQ(header.tensors[0].shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(header.tensors[0].begin, 0);
  EXPECT_EQ(header.tensors[0].end, 4);
  EXPECT_EQ(header.data_offset, static_cast<int64_t>(bytes.size() - 4));
}

TEST(Safetensors, TensorsViewOneSharedMapping) {
  TempDir dir;
  const auto path = dir.file("zero_copy.safetensors");
  StateDict sd;
  sd.insert("a", at::arange(1000, at::kFloat));
  sd.insert("b", at::arange(500, at::kDouble));
  st::save_file(path, sd);

  auto file = st::MappedFile::open(path);
  at::Tensor a = file->tensor("a");
  at::Tensor b = file->tensor("b");
  const auto ranges = mappings_of(path);
  ASSERT_FALSE(ranges.empty());
  const uintptr_t lo = ranges.front().first;
  const uintptr_t hi = ranges.back().second;
  for (const at::Tensor& t : {a, b}) {
    const auto p = reinterpret_cast<uintptr_t>(t.data_ptr());
    EXPECT_GE(p, lo);
    EXPECT_LE(p + t.nbytes(), hi);
  }
  EXPECT_EQ(
      static_cast<char*>(b.data_ptr()) - static_cast<char*>(a.data_ptr()),
      1000 * 4);
  EXPECT_EQ(
      reinterpret_cast<uintptr_t>(a.data_ptr()) - lo,
      static_cast<uintptr_t>(file->header().data_offset));

  // The tensors keep the mapping alive after the file object is gone.
  file.reset();
  EXPECT_FALSE(mappings_of(path).empty());
  EXPECT_TRUE(a.equal(sd["a"]));
  a = at::Tensor();
  b = at::Tensor();
  EXPECT_TRUE(mappings_of(path).empty());
}

TEST(Safetensors, InPlaceWritesLeaveTheFileAlone) {
  TempDir dir;
  const auto path = dir.file("cow.safetensors");
  StateDict sd;
  sd.insert("w", at::arange(4096, at::kFloat));
  st::save_file(path, sd);
  const std::string before = read_bytes(path);

  auto file = st::MappedFile::open(path);
  at::Tensor w = file->tensor("w");
  w.mul_(-1).add_(5);
  EXPECT_EQ(w[3].item<float>(), 2.0f);
  EXPECT_EQ(read_bytes(path), before);
  EXPECT_TRUE(st::load_file(path)["w"].equal(sd["w"]));
  // A second view of the same file object sees the private change.
  EXPECT_EQ(file->tensor("w")[3].item<float>(), 2.0f);
}

TEST(Safetensors, MissingFileAndKey) {
  TempDir dir;
  const auto path = dir.file("absent.safetensors");
  expect_error(
      [&] { st::MappedFile::open(path); },
      {"cannot open '" + path + "': No such file or directory"});
  expect_error([&] { st::load_file(path); }, {path});
  expect_error(
      [&] { st::MappedFile::open(dir.file("")); }, {"not a regular file"});

  const auto real = dir.file("real.safetensors");
  StateDict sd;
  sd.insert("x", at::ones({2}));
  st::save_file(real, sd);
  expect_error(
      [&] { st::MappedFile::open(real)->tensor("y"); },
      {"safetensors file '" + real + "' has no tensor 'y'"});
}

TEST(Safetensors, TruncatedFilesFailCleanly) {
  TempDir dir;
  const auto whole = dir.file("whole.safetensors");
  st::save_file(whole, every_dtype());
  const std::string bytes = read_bytes(whole);
  const int64_t data_offset = st::MappedFile::open(whole)->header().data_offset;
  const std::vector<size_t> cuts = {
      0,
      1,
      7,
      8,
      9,
      static_cast<size_t>(data_offset / 2),
      static_cast<size_t>(data_offset - 1),
      static_cast<size_t>(data_offset),
      static_cast<size_t>(data_offset + 5),
      bytes.size() - 1};
  for (size_t cut : cuts) {
    SCOPED_TRACE("cut at " + std::to_string(cut));
    const auto path = dir.file("cut" + std::to_string(cut));
    write_bytes(path, bytes.substr(0, cut));
    std::vector<std::string> parts = {"'" + path + "'"};
    if (cut < 8 || cut < static_cast<size_t>(data_offset)) {
      parts.push_back("truncated");
    }
    expect_error([&] { st::MappedFile::open(path); }, parts);
  }
  // Extra bytes after the data also break the spec's exact tiling.
  const auto longer = dir.file("longer.safetensors");
  write_bytes(longer, bytes + "x");
  expect_error(
      [&] { st::MappedFile::open(longer); }, {longer, "tensors cover"});
}

struct BadHeader {
  const char* name;
  std::string json;
  std::string data;
  std::vector<std::string> parts;
};

TEST(Safetensors, MalformedHeadersNameFileAndKey) {
  const std::string f32x2 = raw<float>({1, 2});
  const std::vector<BadHeader> cases = {
      {"invalid_json", "{\"a\": {\"dtype\": ", "", {"not valid JSON"}},
      {"empty_header", "", "", {"not valid JSON"}},
      {"not_object", "[1, 2]", "", {"not an object"}},
      {"entry_not_object", "{\"a\": 5}", "", {"'a'", "not described"}},
      {"unknown_dtype",
       "{\"a\":{\"dtype\":\"F8\",\"shape\":[2],\"data_offsets\":[0,2]}}",
       "xx",
       {"'a'", "unknown dtype 'F8'"}},
      {"dtype_not_string",
       "{\"a\":{\"dtype\":4,\"shape\":[2],\"data_offsets\":[0,8]}}",
       f32x2,
       {"'a'", "dtype"}},
      {"missing_shape",
       "{\"a\":{\"dtype\":\"F32\",\"data_offsets\":[0,8]}}",
       f32x2,
       {"'a'", "shape"}},
      {"negative_shape",
       "{\"a\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}",
       f32x2,
       {"'a'", "non-negative"}},
      {"fractional_shape",
       "{\"a\":{\"dtype\":\"F32\",\"shape\":[2.0],\"data_offsets\":[0,8]}}",
       f32x2,
       {"'a'", "non-negative integer"}},
      {"shape_overflow",
       "{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,4],"
       "\"data_offsets\":[0,8]}}",
       f32x2,
       {"'a'", "overflows"}},
      {"bytes_overflow",
       "{\"a\":{\"dtype\":\"F64\",\"shape\":[4611686018427387904],"
       "\"data_offsets\":[0,8]}}",
       f32x2,
       {"'a'", "overflows"}},
      {"offsets_not_pair",
       "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4,8]}}",
       f32x2,
       {"'a'", "data_offsets"}},
      {"negative_offset",
       "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[-8,0]}}",
       f32x2,
       {"'a'", "non-negative"}},
      {"huge_offset",
       "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],"
       "\"data_offsets\":[18446744073709551608,18446744073709551615]}}",
       f32x2,
       {"'a'", "non-negative"}},
      {"reversed_offsets",
       "{\"a\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[8,0]}}",
       f32x2,
       {"'a'", "end before"}},
      {"offsets_beyond_file",
       "{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}",
       f32x2,
       {"'a'", "beyond the data section"}},
      {"size_mismatch",
       "{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}",
       f32x2,
       {"'a'", "need 12"}},
      {"overlap",
       "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
       "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
       raw<float>({1, 2, 3}),
       {"'b'", "overlap", "'a'"}},
      {"same_range",
       "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
       "\"b\":{\"dtype\":\"I32\",\"shape\":[2],\"data_offsets\":[0,8]}}",
       f32x2,
       {"overlap"}},
      {"hole",
       "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
       "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}}",
       raw<float>({1, 2, 3}),
       {"'b'", "belong to no tensor"}},
      {"trailing_data",
       "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}",
       f32x2,
       {"8 bytes", "cover 4"}},
      {"duplicate_key",
       "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
       "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}",
       f32x2,
       {"repeats the key 'a'"}},
      {"metadata_not_object",
       "{\"__metadata__\":[\"x\"]}",
       "",
       {"__metadata__"}},
      {"metadata_not_string",
       "{\"__metadata__\":{\"epoch\":3}}",
       "",
       {"metadata entry 'epoch'", "not a string"}},
      {"deep_nesting",
       std::string(10000, '[') + std::string(10000, ']'),
       "",
       {"nested deeper"}},
      {"rank_above_limit",
       "{\"a\":{\"dtype\":\"U8\",\"shape\":[" + repeat("1,", 2000) +
           "1],\"data_offsets\":[0,1]}}",
       "x",
       {"'a'", "more than 1024"}},
      {"invalid_utf8", "{\"\xff\":{}}", "", {"not valid JSON"}},
  };
  TempDir dir;
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const auto path = dir.file(std::string(c.name) + ".safetensors");
    write_bytes(path, safetensors_bytes(c.json, c.data));
    std::vector<std::string> parts = c.parts;
    parts.push_back("safetensors file '" + path + "'");
    expect_error([&] { st::MappedFile::open(path); }, parts);
  }
}

TEST(Safetensors, HeaderLengthBeyondLimitOrFile) {
  TempDir dir;
  const auto huge = dir.file("huge.safetensors");
  write_bytes(huge, le64(uint64_t(1) << 62) + "{}");
  expect_error(
      [&] { st::MappedFile::open(huge); }, {"'" + huge + "'", "100 MB"});
  const auto max = dir.file("max.safetensors");
  write_bytes(max, le64(~uint64_t(0)) + "{}");
  expect_error([&] { st::MappedFile::open(max); }, {"'" + max + "'", "100 MB"});
  const auto longer = dir.file("longer.safetensors");
  write_bytes(longer, le64(1000) + "{}      ");
  expect_error(
      [&] { st::MappedFile::open(longer); }, {"'" + longer + "'", "truncated"});
}

TEST(Safetensors, SaveRejectsWhatItCannotStore) {
  TempDir dir;
  const auto path = dir.file("bad.safetensors");
  StateDict complex;
  complex.insert("ok", at::ones({1}));
  complex.insert("z", at::ones({2}, at::kComplexFloat));
  expect_error([&] { st::save_file(path, complex); }, {path, "'z'", "dtype"});
  EXPECT_FALSE(fs::exists(path));

  StateDict reserved;
  reserved.insert("__metadata__", at::ones({1}));
  expect_error([&] { st::save_file(path, reserved); }, {path, "reserved"});

  StateDict undefined;
  undefined.insert("u", at::Tensor());
  expect_error([&] { st::save_file(path, undefined); }, {path, "'u'"});

  expect_error(
      [&] {
        st::save_file(dir.file("no/such/dir.safetensors"), every_dtype());
      },
      {"no/such/dir.safetensors", "No such file or directory"});
}

// ---------------------------------------------------------------- .bin

TEST(TorchBin, RoundTripsEveryDtypeInOrder) {
  TempDir dir;
  const auto path = dir.file("all.bin");
  StateDict sd = every_dtype();
  sd.insert("scalar", at::scalar_tensor(-2.25, at::kFloat));
  sd.insert("empty", at::zeros({0, 3}, at::kHalf));
  sd.insert("complex", at::ones({2}, at::kComplexFloat));
  save_bin(path, sd);
  const StateDict loaded = load_bin(path);
  expect_same(sd, loaded);
  EXPECT_EQ(keys(loaded), keys(sd));
}

TEST(TorchBin, KeepsViewsAndSharedStorage) {
  TempDir dir;
  const auto path = dir.file("views.bin");
  const auto base = at::arange(12, at::kFloat).reshape({3, 4});
  StateDict sd;
  sd.insert("base", base);
  sd.insert("transposed", base.t());
  sd.insert("row", base.select(0, 1));
  save_bin(path, sd);
  const StateDict loaded = load_bin(path);
  expect_same(sd, loaded);
  EXPECT_TRUE(loaded["transposed"].is_alias_of(loaded["base"]));
  EXPECT_EQ(loaded["row"].storage_offset(), 4);
}

/// A zip archive holding `pickle` as data.pkl and `records` as data/<key>.
void write_archive(
    const std::string& path,
    const std::string& pickle,
    const std::vector<std::pair<std::string, std::string>>& records) {
  caffe2::serialize::PyTorchStreamWriter writer(path);
  for (const auto& r : records) {
    writer.writeRecord("data/" + r.first, r.second.data(), r.second.size());
  }
  writer.writeRecord("data.pkl", pickle.data(), pickle.size());
  writer.writeEndOfFile();
}

std::string unhex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  }
  return out;
}

// Python's pickle of `nn.Linear(3, 2, bias=False).state_dict()`: an
// OrderedDict of one entry (SETITEM) with a `_metadata` attribute (BUILD).
const char* kPythonStateDictPickle =
    "800263636f6c6c656374696f6e730a4f726465726564446963740a71002952710158060000"
    "00776569676874710263746f7263682e5f7574696c730a5f72656275696c645f74656e736f"
    "725f76320a71032828580700000073746f72616765710463746f7263680a466c6f61745374"
    "6f726167650a71055801000000307106580300000063707571074b06747108514b004b024b"
    "038671094b034b0186710a8968002952710b74710c52710d737d710e58090000005f6d6574"
    "6164617461710f680029527110580000000071117d7112580700000076657273696f6e7113"
    "4b01737373622e";

TEST(TorchBin, ReadsPythonOrderedDictStateDict) {
  TempDir dir;
  const auto path = dir.file("python.bin");
  const auto weight = at::arange(6, at::kFloat);
  write_archive(
      path,
      unhex(kPythonStateDictPickle),
      {{"0", std::string(static_cast<const char*>(weight.data_ptr()), 6 * 4)}});
  const StateDict loaded = load_bin(path);
  ASSERT_EQ(keys(loaded), std::vector<std::string>{"weight"});
  EXPECT_TRUE(loaded["weight"].equal(weight.reshape({2, 3})));
}

TEST(TorchBin, ReadsLibTorchPickleSave) {
  TempDir dir;
  const auto path = dir.file("pickle_save.bin");
  c10::Dict<std::string, at::Tensor> dict;
  dict.insert("a", at::arange(3, at::kLong));
  dict.insert("b", at::ones({2}, at::kBFloat16));
  const std::vector<char> bytes = torch::jit::pickle_save(dict);
  write_bytes(path, std::string(bytes.begin(), bytes.end()));
  const StateDict loaded = load_bin(path);
  EXPECT_EQ(keys(loaded), (std::vector<std::string>{"a", "b"}));
  EXPECT_TRUE(loaded["b"].equal(at::ones({2}, at::kBFloat16)));
}

TEST(TorchBin, Errors) {
  TempDir dir;
  const auto missing = dir.file("missing.bin");
  expect_error(
      [&] { load_bin(missing); },
      {"cannot open '" + missing + "': No such file or directory"});

  const auto whole = dir.file("whole.bin");
  save_bin(whole, every_dtype());
  const std::string bytes = read_bytes(whole);
  for (size_t cut :
       {size_t(0),
        size_t(3),
        size_t(4),
        size_t(100),
        bytes.size() / 2,
        bytes.size() - 30,
        bytes.size() - 1}) {
    SCOPED_TRACE("cut at " + std::to_string(cut));
    const auto path = dir.file("cut" + std::to_string(cut) + ".bin");
    write_bytes(path, bytes.substr(0, cut));
    expect_error([&] { load_bin(path); }, {"'" + path + "'"});
  }

  const auto garbage = dir.file("garbage.bin");
  write_bytes(garbage, "this is not a zip archive at all");
  expect_error([&] { load_bin(garbage); }, {garbage, "zip"});

  const auto legacy = dir.file("legacy.bin");
  write_bytes(legacy, std::string("\x80\x02\x8a\x0a", 4) + "rest");
  expect_error([&] { load_bin(legacy); }, {legacy, "legacy"});

  const auto list = dir.file("list.bin");
  write_archive(list, std::string("\x80\x02]q\x00.", 6), {});
  expect_error(
      [&] { load_bin(list); }, {list, "holds a list, not a dict of tensors"});

  const auto ints = dir.file("ints.bin");
  c10::Dict<std::string, int64_t> int_dict;
  int_dict.insert("epoch", 3);
  const auto int_bytes = torch::jit::pickle_save(int_dict);
  write_bytes(ints, std::string(int_bytes.begin(), int_bytes.end()));
  expect_error([&] { load_bin(ints); }, {ints, "entry 'epoch' is a int"});

  // No code a file names may run: only tensor rebuilding is allowed.
  const auto evil = dir.file("evil.bin");
  write_archive(
      evil,
      std::string(
          "\x80\x02"
          "cos\nsystem\nX\x02\x00\x00\x00id\x85R.",
          23),
      {});
  expect_error([&] { load_bin(evil); }, {evil, "'os.system'"});

  // A tensor reaching past its storage.
  const auto past = dir.file("past.bin");
  const std::string pickle = unhex(kPythonStateDictPickle);
  write_archive(past, pickle, {{"0", std::string(5 * 4, '\0')}});
  expect_error([&] { load_bin(past); }, {past, "shorter than its 6 elements"});
  const auto no_record = dir.file("no_record.bin");
  write_archive(no_record, pickle, {});
  expect_error([&] { load_bin(no_record); }, {no_record, "data/0"});
  const auto cut_pickle = dir.file("cut_pickle.bin");
  write_archive(cut_pickle, pickle.substr(0, 100), {{"0", std::string(24, 0)}});
  expect_error([&] { load_bin(cut_pickle); }, {cut_pickle, "truncated"});

  StateDict undefined;
  undefined.insert("u", at::Tensor());
  expect_error([&] { save_bin(dir.file("u.bin"), undefined); }, {"'u'"});
  expect_error(
      [&] { save_bin(dir.file("no/such/dir.bin"), every_dtype()); },
      {"no/such/dir.bin", "No such file or directory"});
}

} // namespace
