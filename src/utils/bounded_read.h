#pragma once

// Reading the files a user hands in (configs, tokenizers, adapters) with
// bounds (internal; no LibTorch): only regular files, opened without
// blocking (a FIFO or a device in their place is refused, not waited on or
// read forever), of at most a given size; JSON text of bounded nesting,
// checked before a parser or a recursive walk sees it.
//
// The functions return why not ("" when fine), for the caller's own error
// naming the file (the tokenizer's runtime_error, TORCH_CHECK elsewhere).

#include <cstddef>
#include <cstdint>
#include <string>

namespace colossalai {
namespace utils {

/// Why `path` cannot be read as a regular file ("" if it can): missing,
/// unreadable, a directory, a FIFO, a socket or a device.
std::string regular_file_error(const std::string& path);

/// Reads the whole of `path` into `out` when it is a regular file of at
/// most `max_bytes`; otherwise returns why not (as regular_file_error, or
/// its size against the bound) and leaves `out` empty. A FIFO is refused
/// without blocking; a file that grows past the bound while read is too.
std::string read_regular_file(
    const std::string& path,
    uint64_t max_bytes,
    std::string& out);

/// Why JSON `text` nests arrays and objects deeper than `max_depth` levels
/// ("" if it does not): one linear pass, strings and escapes skipped, so a
/// parser and the recursive code after it (copies, dumps, walks) never see
/// such a value. 128 is `serde_json`'s limit, which Hugging Face's
/// `tokenizers` reads tokenizer.json with.
std::string json_depth_error(const std::string& text, size_t max_depth);

/// At most `max_chars` of `text` (whole UTF-8 characters), "..." marking a
/// cut: a value quoted in an error message stays short.
std::string excerpt(const std::string& text, size_t max_chars = 80);

} // namespace utils
} // namespace colossalai
