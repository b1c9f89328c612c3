#include <colossalai/checkpoint_io/io_utils.h>
#include <colossalai/checkpoint_io/torch_bin.h>

#include "../utils/fd_io.h"
#include "pickle_reader.h"
#include "torch_bin_unpickler.h"
#include "zip_records.h"

#include <ATen/core/Dict.h>
#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <unordered_map>

namespace colossalai {
namespace checkpoint_io {
namespace {

// The unpickler and its objects (NOTE [Reading .bin files]).
using detail::Kind;
using detail::kind_name;
using detail::Obj;
using detail::Unpickler;

std::string errno_message(int err) {
  return std::strerror(err);
}

/// Writes through a file descriptor for PyTorchStreamWriter. Errors are kept
/// rather than thrown, because the writer calls back from C code; the caller
/// checks them once the archive is complete.
class FileSink {
 public:
  explicit FileSink(const std::string& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    TORCH_CHECK(
        fd_ >= 0,
        "cannot open '",
        path,
        "' for writing: ",
        errno_message(errno));
  }
  FileSink(const FileSink&) = delete;
  FileSink& operator=(const FileSink&) = delete;
  ~FileSink() {
    if (fd_ >= 0) {
      ::close(fd_);
    }
  }

  /// Always reports `n` bytes written: after a failure the rest is dropped,
  /// and the zip writer never sees an error it would throw from a destructor.
  size_t write(const void* data, size_t n) {
    if (error_ == 0) {
      error_ = utils::write_fully(fd_, data, n);
    }
    return n;
  }

  void close() {
    int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0 && error_ == 0) {
      error_ = errno;
    }
    TORCH_CHECK(
        error_ == 0, "cannot write '", path_, "': ", errno_message(error_));
  }

 private:
  std::string path_;
  int fd_ = -1;
  int error_ = 0;
};

// Deeper than any optimizer or model state (dict -> dict -> dict -> tensor;
// list -> dict -> tuple); a deeper file is malformed or hostile.
constexpr int kMaxDepth = 32;

/// Converts the pickle's objects to IValues. Shared objects (the memo) are
/// converted once, so a file cannot blow up by reference; cycles and deep
/// nesting stop at kMaxDepth.
class ToIValue {
 public:
  explicit ToIValue(const std::string& file) : file_(file) {}

  c10::IValue operator()(Obj* o, int depth = 0) {
    TORCH_CHECK(
        depth < kMaxDepth,
        "'",
        file_,
        "' is not a valid checkpoint: its objects nest deeper than ",
        kMaxDepth,
        " levels (or refer to themselves)");
    auto cached = done_.find(o);
    if (cached != done_.end()) {
      return cached->second;
    }
    c10::IValue v = convert(o, depth);
    done_.emplace(o, v);
    return v;
  }

 private:
  c10::IValue convert(Obj* o, int depth) {
    switch (o->kind) {
      case Kind::None:
        return c10::IValue();
      case Kind::Bool:
        return c10::IValue(o->i != 0);
      case Kind::Int:
        return c10::IValue(o->i);
      case Kind::Float:
        return c10::IValue(o->f);
      case Kind::Str:
      case Kind::Bytes:
        return c10::IValue(o->s);
      case Kind::Tensor:
        return c10::IValue(o->tensor);
      case Kind::Tuple: {
        std::vector<c10::IValue> items;
        for (Obj* item : o->items) {
          items.push_back((*this)(item, depth + 1));
        }
        return c10::ivalue::Tuple::create(std::move(items));
      }
      case Kind::List: {
        c10::impl::GenericList list(c10::AnyType::get());
        for (Obj* item : o->items) {
          list.push_back((*this)(item, depth + 1));
        }
        return list;
      }
      case Kind::Dict: {
        bool all_str = true, all_int = true;
        for (size_t k = 0; k < o->items.size(); k += 2) {
          const Kind kk = o->items[k]->kind;
          TORCH_CHECK(
              kk == Kind::Str || kk == Kind::Int,
              "'",
              file_,
              "' is not a valid checkpoint: a dict has a key of type ",
              kind_name(kk));
          all_str &= kk == Kind::Str;
          all_int &= kk == Kind::Int;
        }
        c10::TypePtr key_type = c10::AnyType::get();
        if (all_str) {
          key_type = c10::StringType::get();
        } else if (all_int) {
          key_type = c10::IntType::get();
        }
        c10::impl::GenericDict dict(key_type, c10::AnyType::get());
        for (size_t k = 0; k < o->items.size(); k += 2) {
          dict.insert_or_assign(
              (*this)(o->items[k], depth + 1),
              (*this)(o->items[k + 1], depth + 1));
        }
        return dict;
      }
      default:
        TORCH_CHECK(
            false,
            "'",
            file_,
            "' is not a valid checkpoint: it holds a ",
            kind_name(o->kind),
            " outside a tensor");
    }
  }

  const std::string& file_;
  std::unordered_map<Obj*, c10::IValue> done_;
};

std::string first_line(const char* what) {
  std::string s(what);
  size_t eol = s.find('\n');
  return eol == std::string::npos ? s : s.substr(0, eol);
}

/// Runs `fn`, turning the errors of the zip reader and the standard library
/// (which do not name the file) into errors that do.
template <class Fn>
auto naming_file(const std::string& path, Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    if (msg.find("'" + path + "'") != std::string::npos) {
      throw;
    }
    TORCH_CHECK(
        false,
        "'",
        path,
        "' is not a valid checkpoint (truncated or corrupt zip): ",
        first_line(msg.c_str()));
  } catch (const std::bad_alloc&) {
    TORCH_CHECK(
        false,
        "'",
        path,
        "' is not a valid checkpoint: it declares records too large to load");
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "'", path, "' is not a valid checkpoint: ", e.what());
  }
}

/// Checks `path` starts like a torch.save zip archive, with a message that
/// says what it is instead.
void check_zip(const std::string& path) {
  const int fd = detail::open_regular(path);
  char magic[4] = {0, 0, 0, 0};
  const ssize_t got = ::pread(fd, magic, sizeof(magic), 0);
  ::close(fd);
  TORCH_CHECK(got > 0, "'", path, "' is empty, not a .bin checkpoint");
  TORCH_CHECK(
      !(got >= 2 && static_cast<uint8_t>(magic[0]) == 0x80),
      "'",
      path,
      "' was written in PyTorch's legacy (pre-1.6) format; re-save it with "
      "torch.save's default zip format");
  TORCH_CHECK(
      got == 4 && std::memcmp(magic, "PK\x03\x04", 4) == 0,
      "'",
      path,
      "' is not a .bin checkpoint (a zip archive from torch.save): ",
      got < 4 ? "it is truncated" : "it does not start like a zip archive");
}

/// The root object of an archive's data.pkl; `keep` holds the objects.
Obj* read_root(
    caffe2::serialize::PyTorchStreamReader& archive,
    const std::string& path,
    std::unique_ptr<Unpickler>& keep,
    const detail::ZipRecords* mapped = nullptr) {
  if (archive.hasRecord("byteorder")) {
    auto record = archive.getRecord("byteorder");
    std::string order(
        static_cast<const char*>(std::get<0>(record).get()),
        std::get<1>(record));
    TORCH_CHECK(
        order == "little",
        "'",
        path,
        "' holds ",
        order,
        "-endian tensors, which are unsupported");
  }
  TORCH_CHECK(
      archive.hasRecord("data.pkl"),
      "'",
      path,
      "' is not a valid .bin checkpoint: it has no data.pkl");
  auto pickle = archive.getRecord("data.pkl");
  keep = std::make_unique<Unpickler>(path, archive, mapped);
  return keep->run(
      static_cast<const char*>(std::get<0>(pickle).get()), std::get<1>(pickle));
}

} // namespace

namespace {

// `value` pickled without type tags (as Python's pickler writes it), with
// the tensors it holds.
struct Pickled {
  std::vector<char> pickle;
  std::unique_ptr<torch::jit::Pickler> pickler;
};
Pickled pickle_untagged(const c10::IValue& value) {
  Pickled out;
  auto* bytes = &out.pickle;
  out.pickler = std::make_unique<torch::jit::Pickler>(
      [bytes](const char* data, size_t n) {
        bytes->insert(bytes->end(), data, data + n);
      },
      /*tensor_table=*/nullptr,
      /*type_renamer=*/nullptr,
      /*memoized_class_types=*/nullptr,
      /*get_tensor_id=*/nullptr,
      /*tag_aggregates=*/false);
  out.pickler->protocol();
  out.pickler->pushIValue(value);
  out.pickler->stop();
  return out;
}

// The zip archive torch.save writes: data.pkl and the tensors' records,
// handed to `write` as they are made.
void write_archive(
    const Pickled& p,
    std::function<size_t(const void*, size_t)> write) {
  caffe2::serialize::PyTorchStreamWriter writer(std::move(write));
  torch::jit::writeArchiveAndTensors(
      "data", p.pickle.data(), p.pickle.size(), p.pickler->tensorData(), writer);
  writer.writeEndOfFile();
}

} // namespace

std::vector<char> pickle_archive(const c10::IValue& value) {
  std::vector<char> out;
  write_archive(pickle_untagged(value), [&](const void* data, size_t n) {
    const auto* c = static_cast<const char*>(data);
    out.insert(out.end(), c, c + n);
    return n;
  });
  return out;
}

void save_bin(const std::string& path, const StateDict& tensors) {
  c10::Dict<std::string, at::Tensor> dict;
  for (const auto& item : tensors) {
    TORCH_CHECK(
        item.value().defined(),
        "cannot save to '",
        path,
        "': tensor '",
        item.key(),
        "' is undefined");
    dict.insert(item.key(), item.value());
  }
  // A plain dict (no LibTorch type tag), as Python's torch.save writes one.
  const auto p = pickle_untagged(c10::IValue(dict));

  // Streamed to the file: the tensors' bytes are not gathered in memory.
  FileSink sink(path);
  write_archive(
      p, [&](const void* data, size_t n) { return sink.write(data, n); });
  sink.close();
}

StateDict load_bin(const std::string& path) {
  check_zip(path);
  return naming_file(path, [&] {
    caffe2::serialize::PyTorchStreamReader archive(path);
    const auto mapped = detail::ZipRecords::open(path);
    std::unique_ptr<Unpickler> unpickler;
    Obj* root = read_root(archive, path, unpickler, mapped.get());
    TORCH_CHECK(
        root->kind == Kind::Dict,
        "'",
        path,
        "' holds a ",
        kind_name(root->kind),
        ", not a dict of tensors");
    StateDict out;
    out.reserve(root->items.size() / 2);
    for (size_t k = 0; k < root->items.size(); k += 2) {
      Obj* key = root->items[k];
      Obj* value = root->items[k + 1];
      TORCH_CHECK(
          key->kind == Kind::Str,
          "'",
          path,
          "' is not a dict of tensors: it has a key of type ",
          kind_name(key->kind));
      TORCH_CHECK(
          value->kind == Kind::Tensor,
          "'",
          path,
          "' is not a dict of tensors: entry '",
          key->s,
          "' is a ",
          kind_name(value->kind));
      out.insert(key->s, value->tensor);
    }
    return out;
  });
}

namespace detail {

c10::IValue load_pickle(
    caffe2::serialize::PyTorchStreamReader& archive,
    const std::string& name) {
  return naming_file(name, [&] {
    std::unique_ptr<Unpickler> unpickler;
    Obj* root = read_root(archive, name, unpickler);
    return ToIValue(name)(root);
  });
}

c10::IValue load_pickle(const std::string& path) {
  check_zip(path);
  return naming_file(path, [&] {
    caffe2::serialize::PyTorchStreamReader archive(path);
    return load_pickle(archive, path);
  });
}

} // namespace detail

} // namespace checkpoint_io
} // namespace colossalai
