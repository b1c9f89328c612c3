// SentencePiece-style tokenizer.json pipelines (normalizer, Metaspace
// pre-tokenizer, decoder), the post-processor, and LlamaTokenizer's pipeline
// (NOTE [SentencePiece] in src/models/tokenizer_sentencepiece.cpp).

#include "tokenizer_internal.h"

#include <algorithm>

namespace colossalai {
namespace models {
namespace tokenizer_detail {

namespace {

// A Replace's pattern when it is a plain string ("\x01", no string, when
// not).
std::string string_pattern(const Field& replace) {
  return replace["pattern"]["String"].str("\x01");
}

// Metaspace's prepend scheme (older files: add_prefix_space).
std::string prepend_scheme(const Field& metaspace) {
  return metaspace.value().contains("prepend_scheme")
      ? metaspace["prepend_scheme"].str()
      : (metaspace["add_prefix_space"].flag(true) ? "always" : "never");
}

} // namespace

bool Reader::is_sentencepiece_json(const Field& root) {
  if (root["model"]["byte_fallback"].flag(false)) {
    return true;
  }
  for (const auto& p : components(root["pre_tokenizer"], "pretokenizers")) {
    if (p["type"].str() == "Metaspace") {
      return true;
    }
  }
  for (const auto& n : components(root["normalizer"], "normalizers")) {
    const auto type = n["type"].str();
    if (type == "Prepend" || (type == "Replace" && string_pattern(n) == " ")) {
      return true;
    }
  }
  return false;
}

void Reader::normalizer(Tokenizer& tok, const Field& root) {
  for (const auto& n : components(root["normalizer"], "normalizers")) {
    const auto type = n["type"].str();
    if (type == "NFC") {
      tok.nfc_ = true;
    } else if (type == "Prepend" && n["prepend"].str() == kSpace) {
      tok.normalizer_prepend_ = true;
    } else if (
        type == "Replace" && string_pattern(n) == " " &&
        n["content"].str() == kSpace) {
      tok.normalizer_replace_ = true;
    } else {
      fail(
          n.file(),
          "normalizer " + brief(n.value()) +
              " is not supported (NFC; for SentencePiece-style files "
              "Prepend(\"\xE2\x96\x81\") and Replace(\" \", "
              "\"\xE2\x96\x81\"))");
    }
  }
}

void Reader::sentencepiece_pipeline(Tokenizer& tok, const Field& root) {
  tok.kind_ = Tokenizer::Kind::kSentencePiece;
  const Field model = root["model"];
  tok.byte_fallback_ = model["byte_fallback"].flag(false);
  tok.fuse_unk_ = model["fuse_unk"].flag(false);

  const Field pre = root["pre_tokenizer"];
  if (!pre.is_null()) {
    if (pre["type"].str() != "Metaspace" ||
        pre["replacement"].str(kSpace) != kSpace) {
      fail(
          pre.file(),
          "pre_tokenizer " + brief(pre.value()) +
              " is not supported (SentencePiece-style files: none, or "
              "Metaspace with replacement \"\xE2\x96\x81\")");
    }
    tok.metaspace_ = true;
    const auto scheme = prepend_scheme(pre);
    if (scheme == "always") {
      tok.prepend_ = Tokenizer::Prepend::kAlways;
    } else if (scheme == "first") {
      tok.prepend_ = Tokenizer::Prepend::kFirst;
    } else if (scheme == "never") {
      tok.prepend_ = Tokenizer::Prepend::kNever;
    } else {
      pre["prepend_scheme"].bad("must be \"always\", \"first\" or \"never\"");
    }
    tok.metaspace_split_ = pre["split"].flag(true);
  }

  tok.decode_replace_ = tok.decode_byte_fallback_ = false;
  tok.decode_strip_ = 0;
  for (const auto& d : components(root["decoder"], "decoders")) {
    const auto type = d["type"].str();
    if (type == "Replace" && string_pattern(d) == kSpace &&
        d["content"].str() == " ") {
      tok.decode_replace_ = true;
    } else if (type == "ByteFallback") {
      tok.decode_byte_fallback_ = true;
    } else if (type == "Fuse") {
    } else if (
        type == "Strip" && d["content"].str() == " " &&
        d["stop"].integer(0, 0, 0) == 0) {
      tok.decode_strip_ = static_cast<int>(d["start"].integer(0, 0, 1 << 20));
    } else if (type == "Metaspace") {
      tok.decode_replace_ = true;
      tok.decode_strip_ = prepend_scheme(d) == "never" ? 0 : 1;
    } else {
      fail(
          d.file(),
          "decoder " + brief(d.value()) +
              " is not supported (SentencePiece-style files: Replace "
              "\"\xE2\x96\x81\" -> \" \", ByteFallback, Fuse, Strip, or "
              "Metaspace)");
    }
  }
}

void Reader::post_processor(Tokenizer& tok, const Field& p) {
  if (p.is_null()) {
    return;
  }
  const auto type = p["type"].str();
  // An id of the vocabulary (NOTE [Token ids]).
  const auto vocab_id = [&](const Field& id) {
    const int64_t n = static_cast<int64_t>(tok.tokens_.size());
    return id.integer(-1, 0, std::max<int64_t>(n - 1, 0));
  };
  auto special_id = [&](const Field& pair) {
    if (!pair.value().is_array() || pair.value().size() != 2) {
      pair.bad("must be [token, id]");
    }
    return vocab_id(pair[size_t{1}]);
  };
  if (type == "ByteLevel") {
    return; // offsets only
  } else if (type == "Sequence") {
    // Nesting is bounded by kMaxJsonDepth, so is this recursion.
    for (const auto& q : p["processors"].elements()) {
      post_processor(tok, q);
    }
  } else if (type == "BertProcessing" || type == "RobertaProcessing") {
    tok.prefix_ids_ = {special_id(p["cls"])};
    tok.suffix_ids_ = {special_id(p["sep"])};
  } else if (type == "TemplateProcessing") {
    tok.prefix_ids_.clear();
    tok.suffix_ids_.clear();
    bool seen_sequence = false;
    const Field specials = p["special_tokens"];
    for (const auto& item : p["single"].elements()) {
      if (item.value().contains("Sequence")) {
        seen_sequence = true;
        continue;
      }
      const auto name = item["SpecialToken"]["id"].str();
      const Field ids = specials[name]["ids"];
      if (name.empty() || !ids.value().is_array()) {
        fail(
            p.file(),
            "malformed: post_processor.single names " + brief(json(name)) +
                ", which post_processor.special_tokens lacks");
      }
      auto& to = seen_sequence ? tok.suffix_ids_ : tok.prefix_ids_;
      for (const auto& id : ids.elements()) {
        to.push_back(vocab_id(id));
      }
    }
  } else {
    fail(
        p.file(),
        "post_processor " + brief(json(type)) +
            " is not supported (ByteLevel, TemplateProcessing, "
            "BertProcessing, RobertaProcessing or a Sequence of them)");
  }
}

void Reader::llama_pipeline(Tokenizer& tok, const Field& config) {
  tok.kind_ = Tokenizer::Kind::kSentencePiece;
  tok.llama_pipeline_ = true;
  tok.nfc_ = tok.normalizer_prepend_ = tok.normalizer_replace_ = false;
  tok.byte_fallback_ = true;
  tok.fuse_unk_ = true;
  tok.unk_id_ = -1;
  tok.metaspace_ = true;
  tok.metaspace_split_ = false;
  const bool add_prefix_space = config["add_prefix_space"].flag(true);
  tok.prepend_ = !add_prefix_space      ? Tokenizer::Prepend::kNever
      : config["legacy"].flag(false) ? Tokenizer::Prepend::kAlways
                                     : Tokenizer::Prepend::kFirst;
  tok.decode_replace_ = tok.decode_byte_fallback_ = true;
  tok.decode_strip_ = add_prefix_space ? 1 : 0;
}

} // namespace tokenizer_detail
} // namespace models
} // namespace colossalai
