#pragma once

/// Chat templates as transformers renders them (`tokenizer_config.json`'s
/// `chat_template`, a Jinja template; `apply_chat_template`), in plain C++.
///
/// NOTE [Chat templates]
/// No C++ Jinja engine is packaged for Debian or PyPI, so this is our own
/// interpreter of the subset model templates use, with transformers'
/// environment (trim_blocks, lstrip_blocks; `raise_exception`,
/// `strftime_now`): text, `{{ }}` and `{% %}` with `-` whitespace control,
/// comments; `for` (with `loop.index0` / `index` / `first` / `last` /
/// `length` / `revindex`, tuple targets, an `if` filter and `else`), `if` /
/// `elif` / `else`, `set` (names and `namespace()` attributes);
/// expressions with Python's rules for `+ - * / // % ~`, comparisons, `in`,
/// `and` / `or` / `not`, `x if c else y`, subscripts and slices, attribute
/// access falling back to items, list and dict literals; the filters trim,
/// length, count, upper, lower, title, capitalize, string, int, default,
/// first, last, join, replace, reverse, list, items, tojson; the tests
/// defined, undefined, none, string, number, mapping, sequence, iterable,
/// true, false, odd, even, equalto; string methods strip, lstrip, rstrip,
/// upper, lower, title, capitalize, startswith, endswith, split, replace,
/// and dict methods get, items, keys, values. Anything else (macros,
/// `call`, `include`, an unknown filter, test or function) is refused by
/// name when the template is read, so a template either renders as
/// transformers does or fails before any data is touched.
///
/// Example:
/// \code
///   auto tpl = colossalai::models::ChatTemplate::from_pretrained(dir);
///   std::string text = tpl.apply(
///       {{"system", "Be brief."}, {"user", "Hi"}},
///       colossalai::models::ChatTemplateOptions()
///           .add_generation_prompt(true)
///           .bos_token("<s>")
///           .eos_token("</s>"));
/// \endcode

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace colossalai {
namespace models {

class Tokenizer;

namespace chat_template_detail {
struct Node;
} // namespace chat_template_detail

/// One message of a conversation.
struct ChatMessage {
  std::string role;
  std::string content;
};

/// The variables a template sees beside `messages`.
struct ChatTemplateOptions {
  /// Ends the text with the opening of an assistant turn.
  ChatTemplateOptions& add_generation_prompt(bool v) {
    add_generation_prompt_ = v;
    return *this;
  }
  ChatTemplateOptions& bos_token(std::string v) {
    bos_token_ = std::move(v);
    return *this;
  }
  ChatTemplateOptions& eos_token(std::string v) {
    eos_token_ = std::move(v);
    return *this;
  }
  /// Any other variables, as one JSON object ("{\"tools\": null}").
  ChatTemplateOptions& extra_json(std::string v) {
    extra_json_ = std::move(v);
    return *this;
  }
  bool add_generation_prompt() const {
    return add_generation_prompt_;
  }
  const std::string& bos_token() const {
    return bos_token_;
  }
  const std::string& eos_token() const {
    return eos_token_;
  }
  const std::string& extra_json() const {
    return extra_json_;
  }

 private:
  bool add_generation_prompt_ = false;
  std::string bos_token_, eos_token_;
  std::string extra_json_;
};

/// A template that cannot be read (what and where) or that raised while
/// rendering (`raise_exception`'s message).
class ChatTemplateError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A parsed chat template.
class ChatTemplate {
 public:
  /// Parses `source`; a ChatTemplateError names what is outside the
  /// supported subset and where (line and column).
  explicit ChatTemplate(const std::string& source);
  /// The template of a model directory: tokenizer_config.json's
  /// `chat_template` (a string, or transformers' list of named templates:
  /// `name`), else chat_template.jinja (transformers 4.43+).
  static ChatTemplate from_pretrained(
      const std::string& dir,
      const std::string& name = "default");

  /// The text transformers' `apply_chat_template(messages, tokenize=False)`
  /// gives.
  std::string apply(
      const std::vector<ChatMessage>& messages,
      const ChatTemplateOptions& options = {}) const;

  const std::string& source() const {
    return source_;
  }

 private:
  std::string source_;
  std::shared_ptr<const chat_template_detail::Node> root_;
};

/// The ids transformers' `apply_chat_template(messages, tokenize=True)`
/// gives: the rendered text encoded without added special tokens (the
/// template writes them), with the tokenizer's bos / eos tokens as
/// `bos_token` / `eos_token`.
std::vector<int64_t> apply_chat_template(
    const Tokenizer& tokenizer,
    const ChatTemplate& chat_template,
    const std::vector<ChatMessage>& messages,
    bool add_generation_prompt = false);

} // namespace models
} // namespace colossalai
