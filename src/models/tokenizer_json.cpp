// Reading a tokenizer's tokenizer.json, vocab.json + merges.txt and
// tokenizer_config.json (see include/colossalai/models/tokenizer.h). Every
// field is type-checked and every id bounded by the file (NOTE [Token ids]);
// errors name the file and the field.

#include "tokenizer_internal.h"

#include <functional>
#include <sstream>

namespace colossalai {
namespace models {
namespace tokenizer_detail {
namespace {

// NOTE [Token ids]
// Ids index dense tables (the token of each id), so an id is below the
// number of tokens the file lists: the vocabulary's entries plus the added
// tokens (which may take ids beyond the vocabulary, as LLaMA 3's and
// Qwen 2's do). Every real vocabulary numbers its tokens so; one id of 1e8
// in a small file would otherwise make a table of 1e8 strings.
bool valid_id(const json& id, int64_t bound) {
  return id.is_number_unsigned()
      ? id.get<uint64_t>() < static_cast<uint64_t>(bound)
      : id.is_number_integer() && id.get<int64_t>() >= 0 &&
          id.get<int64_t>() < bound;
}

std::string id_rule(int64_t bound) {
  return "ids are integers from 0 to " + std::to_string(bound - 1) +
      ", below the number of tokens the file lists";
}

// A vocabulary object {token: id}.
template <class Add>
void read_vocab(const Field& vocab, int64_t bound, const Add& add) {
  if (!vocab.is_object()) {
    vocab.bad("must be an object of token -> id");
  }
  for (const auto& kv : vocab.value().items()) {
    if (!valid_id(kv.value(), bound)) {
      fail(
          vocab.file(),
          "malformed: field '" + vocab.path() + "' gives " +
              brief(json(kv.key())) + " the id " + brief(kv.value()) + ": " +
              id_rule(bound));
    }
    add(kv.key(), kv.value().get<int64_t>());
  }
}

// A merge "a b" (or ["a", "b"]) whose tokens and their concatenation are in
// the vocabulary.
std::pair<std::string, std::string> split_merge(
    const std::string& s,
    const std::function<void(const std::string&)>& bad) {
  const auto sp = s.find(' ');
  if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos) {
    bad("is not \"a b\"");
  }
  return {s.substr(0, sp), s.substr(sp + 1)};
}

} // namespace

void Reader::tokenizer_json(Tokenizer& tok, const fs::path& f) {
  const auto j = read_json(f, kMaxTokenizerFileBytes);
  const Field root(j, "", f);
  if (!root.is_object()) {
    fail(f, "malformed: not a JSON object");
  }
  const Field model = root["model"];
  if (!model.is_object()) {
    model.bad("must be an object (the tokenizer's model)");
  }
  const std::string type =
      model["type"].str(model.value().contains("merges") ? "BPE" : "");
  if (type != "BPE") {
    fail(
        f,
        "model type " + brief(json(type)) +
            " is not supported (BPE: byte-level or SentencePiece-style)");
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (!model[key].str().empty()) {
      fail(
          f,
          std::string("model.") + key +
              " is not supported (not GPT-2's byte-level BPE)");
    }
  }
  const bool sentencepiece = is_sentencepiece_json(root);
  normalizer(tok, root);
  if (sentencepiece) {
    sentencepiece_pipeline(tok, root);
  } else {
    byte_level_pre_tokenizer(tok, root["pre_tokenizer"]);
  }

  const Field added = root["added_tokens"];
  const int64_t bound = static_cast<int64_t>(model["vocab"].value().size()) +
      (added.value().is_array() ? static_cast<int64_t>(added.value().size())
                                : 0);
  read_vocab(model["vocab"], bound, [&](const std::string& t, int64_t id) {
    tok.add_token(t, id);
  });
  const Field merges = model["merges"];
  if (!merges.value().is_array()) {
    merges.bad("must be a list of merges");
  }
  for (const auto& m : merges.elements()) {
    if (m.value().is_array() && m.value().size() != 2) {
      m.bad("is neither \"a b\" nor [a, b]");
    }
    auto bad = [&](const std::string& what) { m.bad(what); };
    const auto [a, b] = m.value().is_array()
        ? std::make_pair(m[size_t{0}].str(), m[size_t{1}].str())
        : split_merge(m.str(), bad);
    if (!tok.vocab_.count(a) || !tok.vocab_.count(b) ||
        !tok.vocab_.count(a + b)) {
      m.bad("uses a token not in model.vocab");
    }
    tok.add_merge(a, b);
  }
  tok.ignore_merges_ = model["ignore_merges"].flag(false);
  const auto unk = model["unk_token"].str();
  if (!unk.empty()) {
    tok.unk_id_ = tok.token_to_id(unk);
  }
  for (const auto& t : added.elements()) {
    if (!t.is_object()) {
      t.bad("must be an object with id and content");
    }
    Tokenizer::AddedToken a;
    if (!valid_id(t["id"].value(), bound)) {
      t["id"].bad("must be an id (" + id_rule(bound) + ")");
    }
    a.id = t["id"].value().get<int64_t>();
    a.content = t["content"].str();
    a.special = t["special"].flag(false);
    a.normalized = t["normalized"].flag(!a.special);
    a.lstrip = t["lstrip"].flag(false);
    a.rstrip = t["rstrip"].flag(false);
    if (a.content.empty()) {
      continue;
    }
    if (static_cast<int64_t>(tok.tokens_.size()) <= a.id) {
      tok.tokens_.resize(a.id + 1);
    }
    if (tok.tokens_[a.id].empty()) {
      tok.tokens_[a.id] = a.content;
    }
    tok.push_added(std::move(a));
  }
  post_processor(tok, root["post_processor"]);
}

// The byte-level pre-tokenizer: ByteLevel, or a Split (GPT-2's, LLaMA 3's,
// Qwen 2's or Bloom's regex, isolated) then a ByteLevel without its regex.
void Reader::byte_level_pre_tokenizer(Tokenizer& tok, const Field& pre) {
  const auto parts = components(pre, "pretokenizers");
  auto byte_level = [](const Field& p) {
    if (p["type"].str() != "ByteLevel") {
      return false;
    }
    if (p["add_prefix_space"].flag(false)) {
      fail(
          p.file(),
          "field '" + p.path() +
              "': ByteLevel add_prefix_space=true is not supported");
    }
    return true;
  };
  if (parts.size() == 1 && byte_level(parts[0])) {
    tok.split_ = parts[0]["use_regex"].flag(true) ? Tokenizer::Split::kGpt2
                                                  : Tokenizer::Split::kNone;
    return;
  }
  if (parts.size() == 2 && parts[0]["type"].str() == "Split" &&
      byte_level(parts[1]) && !parts[1]["use_regex"].flag(true)) {
    const auto& split = parts[0];
    const auto regex = split["pattern"]["Regex"].str();
    if (split["behavior"].str() != "Isolated" || split["invert"].flag(false) ||
        (regex != kGpt2Pattern && regex != kBloomPattern &&
         regex != kLlama3Pattern && regex != kQwen2Pattern)) {
      fail(
          split.file(),
          "field '" + split.path() + "': Split " + brief(json(regex)) +
              " is not supported (GPT-2's, LLaMA 3's, Qwen 2's or Bloom's "
              "regex, isolated)");
    }
    tok.split_ = regex == kGpt2Pattern ? Tokenizer::Split::kGpt2
        : regex == kLlama3Pattern ? Tokenizer::Split::kLlama3
        : regex == kQwen2Pattern  ? Tokenizer::Split::kQwen2
                                  : Tokenizer::Split::kBloom;
    return;
  }
  fail(
      pre.file(),
      "pre_tokenizer " + brief(pre.value()) +
          " is not supported (ByteLevel, or Metaspace for SentencePiece-style "
          "files)");
}

void Reader::vocab_and_merges(
    Tokenizer& tok,
    const fs::path& vocab_json,
    const fs::path& merges_txt) {
  if (!fs::exists(vocab_json)) {
    fail(vocab_json, "missing (merges.txt needs it)");
  }
  if (!fs::exists(merges_txt)) {
    fail(merges_txt, "missing (vocab.json needs it)");
  }
  const auto v = read_json(vocab_json, kMaxTokenizerFileBytes);
  const Field vocab(v, "", vocab_json);
  if (!vocab.is_object()) {
    fail(vocab_json, "malformed: not an object of token -> id");
  }
  read_vocab(
      vocab,
      static_cast<int64_t>(v.size()),
      [&](const std::string& t, int64_t id) { tok.add_token(t, id); });
  std::istringstream lines(read_text(merges_txt, kMaxTokenizerFileBytes));
  std::string line;
  size_t number = 0;
  while (std::getline(lines, line)) {
    ++number;
    if (!line.empty() && line.back() == '\r') {
      line.pop_back();
    }
    if (line.empty() || line.rfind("#version", 0) == 0) {
      continue;
    }
    auto bad = [&](const std::string& what) {
      fail(
          merges_txt,
          "malformed: line " + std::to_string(number) + " " +
              brief(json(line)) + " " + what);
    };
    const auto [a, b] = split_merge(line, bad);
    if (!tok.vocab_.count(a) || !tok.vocab_.count(b) ||
        !tok.vocab_.count(a + b)) {
      bad("uses a token not in vocab.json");
    }
    tok.add_merge(a, b);
  }
}

void Reader::config(Tokenizer& tok, const Field& config, bool llama) {
  if (llama) {
    llama_pipeline(tok, config);
  }
  const Field decoder = config["added_tokens_decoder"];
  if (decoder.is_object()) {
    for (const auto& kv : decoder.value().items()) {
      const Field entry = decoder[kv.key()];
      const auto content = token_content(entry);
      const bool special = entry["special"].flag(true);
      if (!content.empty() && tok.vocab_.count(content)) {
        tok.add_special(content, special);
      }
    }
  }
  const bool sp = tok.kind_ == Tokenizer::Kind::kSentencePiece;
  auto special = [&](const char* key, const char* sentencepiece) {
    return config.value().contains(key)
        ? token_content(config[key])
        : std::string(sp ? sentencepiece : kEndOfText);
  };
  tok.eos_token_ = special("eos_token", "</s>");
  tok.bos_token_ = special("bos_token", "<s>");
  tok.unk_token_ = special("unk_token", "<unk>");
  for (const auto& s :
       {tok.eos_token_,
        tok.bos_token_,
        tok.unk_token_,
        token_content(config["pad_token"])}) {
    tok.add_special(s);
  }
  const Field max_length = config["model_max_length"];
  if (!max_length.is_null()) {
    if (!max_length.value().is_number() ||
        !(max_length.value().get<double>() >= 0)) {
      max_length.bad("must be a number >= 0");
    }
    // transformers writes 1e30 for "no limit".
    const double m = max_length.value().get<double>();
    tok.model_max_length_ = m >= 9.2e18 ? INT64_MAX : static_cast<int64_t>(m);
  }
}

} // namespace tokenizer_detail
} // namespace models
} // namespace colossalai
