// The safetensors header: the dtype table, and parsing and validating the
// header's JSON (entries, duplicate keys, nesting, byte ranges tiling data).

#include <colossalai/checkpoint_io/safetensors.h>

#include "safetensors_internal.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>
#include <sstream>
#include <unordered_set>
#include <utility>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors stores little-endian data; big-endian hosts are unsupported"
#endif

namespace colossalai {
namespace checkpoint_io {
namespace safetensors {
namespace {

using detail::Json;

constexpr uint64_t kMaxHeaderBytes = 100ull * 1000 * 1000;
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
/// Deepest legal nesting: root object > entry > shape array > number.
constexpr int kMaxJsonDepth = 3;
/// Most entries a shape may have; far above any real tensor's rank, it keeps
/// a hostile header from costing gigabytes of parsed JSON.
constexpr size_t kMaxRank = 1024;

struct DtypeName {
  const char* name;
  at::ScalarType dtype;
};

constexpr DtypeName kDtypes[] = {
    {"F64", at::kDouble},
    {"F32", at::kFloat},
    {"F16", at::kHalf},
    {"BF16", at::kBFloat16},
    {"I64", at::kLong},
    {"I32", at::kInt},
    {"I16", at::kShort},
    {"I8", at::kChar},
    {"U8", at::kByte},
    {"BOOL", at::kBool},
};

bool parse_dtype(const std::string& name, at::ScalarType* dtype) {
  for (const auto& d : kDtypes) {
    if (name == d.name) {
      *dtype = d.dtype;
      return true;
    }
  }
  return false;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    out << (i ? ", " : "") << shape[i];
  }
  out << "]";
  return out.str();
}

/// A JSON number that is a non-negative integer fitting int64, or -1.
int64_t non_negative_int(const Json& v) {
  if (!v.is_number_unsigned()) {
    return -1;
  }
  uint64_t u = v.get<uint64_t>();
  return u > static_cast<uint64_t>(kInt64Max) ? -1 : static_cast<int64_t>(u);
}

TensorInfo parse_entry(
    const std::string& name,
    const Json& entry,
    int64_t data_bytes,
    const std::string& file) {
  const std::string where =
      "safetensors file '" + file + "': tensor '" + name + "' ";
  TORCH_CHECK(entry.is_object(), where, "is not described by a JSON object");
  TensorInfo info;
  info.name = name;

  auto dtype_it = entry.find("dtype");
  TORCH_CHECK(
      dtype_it != entry.end() && dtype_it->is_string(),
      where,
      "has no string \"dtype\"");
  const std::string& dtype = dtype_it->get_ref<const std::string&>();
  TORCH_CHECK(
      parse_dtype(dtype, &info.dtype),
      where,
      "has unknown dtype '",
      dtype,
      "' (expected F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL)");

  auto shape_it = entry.find("shape");
  TORCH_CHECK(
      shape_it != entry.end() && shape_it->is_array(),
      where,
      "has no \"shape\" array");
  // The product of the non-zero dims must fit, so strides computed by
  // LibTorch never overflow even when another dim is 0.
  int64_t numel = 1;
  bool has_zero = false;
  for (const Json& dim : *shape_it) {
    int64_t d = non_negative_int(dim);
    TORCH_CHECK(
        d >= 0,
        where,
        "has a shape entry that is not a non-negative integer: ",
        dim.dump());
    info.shape.push_back(d);
    if (d == 0) {
      has_zero = true;
    } else {
      TORCH_CHECK(
          !__builtin_mul_overflow(numel, d, &numel),
          where,
          "has shape ",
          shape_string(info.shape),
          "... whose element count overflows");
    }
  }
  if (has_zero) {
    numel = 0;
  }
  int64_t nbytes = 0;
  TORCH_CHECK(
      !__builtin_mul_overflow(
          numel, static_cast<int64_t>(c10::elementSize(info.dtype)), &nbytes),
      where,
      "has shape ",
      shape_string(info.shape),
      " whose byte size overflows");

  auto offsets_it = entry.find("data_offsets");
  TORCH_CHECK(
      offsets_it != entry.end() && offsets_it->is_array() &&
          offsets_it->size() == 2,
      where,
      "has no \"data_offsets\" pair");
  info.begin = non_negative_int((*offsets_it)[0]);
  info.end = non_negative_int((*offsets_it)[1]);
  TORCH_CHECK(
      info.begin >= 0 && info.end >= 0,
      where,
      "has data_offsets that are not non-negative integers: ",
      offsets_it->dump());
  TORCH_CHECK(
      info.begin <= info.end,
      where,
      "has data_offsets [",
      info.begin,
      ", ",
      info.end,
      "] that end before they begin");
  TORCH_CHECK(
      info.end <= data_bytes,
      where,
      "has data_offsets [",
      info.begin,
      ", ",
      info.end,
      "] beyond the data section's ",
      data_bytes,
      " bytes (is the file truncated?)");
  TORCH_CHECK(
      info.end - info.begin == nbytes,
      where,
      "has data_offsets [",
      info.begin,
      ", ",
      info.end,
      "] spanning ",
      info.end - info.begin,
      " bytes, but dtype ",
      dtype,
      " and shape ",
      shape_string(info.shape),
      " need ",
      nbytes);
  return info;
}

Json parse_json(
    const uint8_t* begin,
    const uint8_t* end,
    const std::string& file) {
  // Keys seen so far in the object open at each depth: duplicates would make
  // the header ambiguous.
  std::vector<std::unordered_set<std::string>> keys(kMaxJsonDepth + 2);
  std::string tensor; // the top-level key being parsed
  size_t entries = 0; // in the array being parsed
  auto callback = [&](int depth, Json::parse_event_t event, Json& parsed) {
    // Bounding the depth bounds the parser's memory on hostile input.
    TORCH_CHECK(
        depth <= kMaxJsonDepth,
        "safetensors file '",
        file,
        "': header JSON is nested deeper than a safetensors header can be");
    if (depth == kMaxJsonDepth) {
      TORCH_CHECK(
          ++entries <= kMaxRank,
          "safetensors file '",
          file,
          "': tensor '",
          tensor,
          "' has an array of more than ",
          kMaxRank,
          " entries");
    }
    if (event == Json::parse_event_t::array_start) {
      entries = 0;
    } else if (event == Json::parse_event_t::object_start) {
      keys[depth + 1].clear();
    } else if (event == Json::parse_event_t::key) {
      const auto& key = parsed.get_ref<const std::string&>();
      TORCH_CHECK(
          keys[depth].insert(key).second,
          "safetensors file '",
          file,
          "': header JSON repeats the key '",
          key,
          "'");
      if (depth == 1) {
        tensor = key;
      }
    }
    return true;
  };
  try {
    return Json::parse(begin, end, callback);
  } catch (const Json::exception& e) {
    TORCH_CHECK(
        false,
        "safetensors file '",
        file,
        "': header is not valid JSON: ",
        e.what());
  }
}

} // namespace

namespace detail {

const char* dtype_name(at::ScalarType dtype) {
  for (const auto& d : kDtypes) {
    if (d.dtype == dtype) {
      return d.name;
    }
  }
  return nullptr;
}

} // namespace detail

Header parse_header(const uint8_t* data, size_t size, const std::string& file) {
  TORCH_CHECK(
      size >= 8,
      "safetensors file '",
      file,
      "' is truncated: ",
      size,
      " bytes, less than the 8-byte header length");
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) {
    n |= static_cast<uint64_t>(data[i]) << (8 * i);
  }
  TORCH_CHECK(
      n <= kMaxHeaderBytes,
      "safetensors file '",
      file,
      "' declares a header of ",
      n,
      " bytes, above the 100 MB limit (corrupt or not a safetensors file)");
  TORCH_CHECK(
      n <= size - 8,
      "safetensors file '",
      file,
      "' is truncated: the header needs ",
      n,
      " bytes after the length but the file has ",
      size - 8);

  Header header;
  header.data_offset = static_cast<int64_t>(8 + n);
  const int64_t data_bytes = static_cast<int64_t>(size) - header.data_offset;
  Json json = parse_json(data + 8, data + 8 + n, file);
  TORCH_CHECK(
      json.is_object(),
      "safetensors file '",
      file,
      "': header is JSON but not an object");

  for (auto it = json.begin(); it != json.end(); ++it) {
    const std::string& key = it.key();
    const Json& value = it.value();
    if (key == "__metadata__") {
      TORCH_CHECK(
          value.is_object(),
          "safetensors file '",
          file,
          "': \"__metadata__\" is not a JSON object");
      for (auto m = value.begin(); m != value.end(); ++m) {
        TORCH_CHECK(
            m.value().is_string(),
            "safetensors file '",
            file,
            "': metadata entry '",
            m.key(),
            "' is not a string");
        header.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    header.tensors.push_back(parse_entry(key, value, data_bytes, file));
  }

  // The spec requires the byte ranges to tile the data section; ties keep
  // header order, with empty tensors before the one starting at their offset.
  std::stable_sort(
      header.tensors.begin(),
      header.tensors.end(),
      [](const TensorInfo& a, const TensorInfo& b) {
        return std::make_pair(a.begin, a.end) < std::make_pair(b.begin, b.end);
      });
  int64_t cursor = 0;
  const TensorInfo* previous = nullptr;
  for (const TensorInfo& info : header.tensors) {
    TORCH_CHECK(
        info.begin >= cursor,
        "safetensors file '",
        file,
        "': tensor '",
        info.name,
        "' bytes [",
        info.begin,
        ", ",
        info.end,
        ") overlap tensor '",
        previous ? previous->name : std::string(),
        "' bytes [",
        previous ? previous->begin : 0,
        ", ",
        previous ? previous->end : 0,
        ")");
    TORCH_CHECK(
        info.begin == cursor,
        "safetensors file '",
        file,
        "': data bytes [",
        cursor,
        ", ",
        info.begin,
        ") before tensor '",
        info.name,
        "' belong to no tensor");
    cursor = info.end;
    previous = &info;
  }
  TORCH_CHECK(
      cursor == data_bytes,
      "safetensors file '",
      file,
      "': the data section has ",
      data_bytes,
      " bytes but its tensors cover ",
      cursor);
  return header;
}

} // namespace safetensors
} // namespace checkpoint_io
} // namespace colossalai
