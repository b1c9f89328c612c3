// Tokenizer::save_pretrained: GPT-2's vocab.json + merges.txt, or
// tokenizer.json with the whole pipeline; tokenizer_config.json. See
// include/colossalai/models/tokenizer.h.

#include "tokenizer_internal.h"

#include <algorithm>

namespace colossalai {
namespace models {

using namespace tokenizer_detail;

void Tokenizer::save_pretrained(const std::string& dir) const {
  const fs::path root(dir);
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) {
    fail(root, "cannot be created: " + ec.message());
  }
  // GPT-2's own pipeline as GPT-2 ships it; any other (SentencePiece,
  // another split regex, NFC, a template, ignore_merges) as tokenizer.json,
  // which carries the whole pipeline.
  const bool gpt2 = kind_ == Kind::kByteLevel && split_ == Split::kGpt2 &&
      !nfc_ && prefix_ids_.empty() && suffix_ids_.empty() && !ignore_merges_;
  if (!gpt2) {
    save_tokenizer_json(dir);
    return;
  }
  // vocab.json by id, added tokens included (transformers finds their ids
  // there).
  ordered_json vocab = ordered_json::object();
  for (size_t id = 0; id < tokens_.size(); ++id) {
    if (!tokens_[id].empty()) {
      vocab[tokens_[id]] = static_cast<int64_t>(id);
    }
  }
  write_whole(root / "vocab.json", vocab.dump(-1, ' ', false) + "\n");
  std::string merges = "#version: 0.2\n";
  for (const auto& m : merges_) {
    merges += tokens_[m.first] + " " + tokens_[m.second] + "\n";
  }
  write_whole(root / "merges.txt", merges);

  write_config(dir, "GPT2Tokenizer", {{"add_prefix_space", false}});
}

std::vector<const Tokenizer::AddedToken*> Tokenizer::added_by_id() const {
  std::vector<const AddedToken*> sorted;
  for (const auto& t : added_) {
    sorted.push_back(&t);
  }
  std::sort(sorted.begin(), sorted.end(), [](const auto* x, const auto* y) {
    return x->id < y->id;
  });
  return sorted;
}

void Tokenizer::write_config(
    const std::string& dir,
    const std::string& tokenizer_class,
    const std::vector<std::pair<std::string, bool>>& flags) const {
  ordered_json config = ordered_json::object();
  config["tokenizer_class"] = tokenizer_class;
  for (const auto& [name, value] : flags) {
    config[name] = value;
  }
  auto special = [&](const std::string& s) {
    return s.empty() || token_to_id(s) < 0 ? ordered_json(nullptr)
                                           : ordered_json(s);
  };
  config["eos_token"] = special(eos_token_);
  config["bos_token"] = special(bos_token_);
  config["unk_token"] = special(unk_token_);
  config["model_max_length"] = model_max_length_;
  ordered_json added = ordered_json::object();
  for (const auto* t : added_by_id()) {
    added[std::to_string(t->id)] = {
        {"content", t->content},
        {"lstrip", t->lstrip},
        {"normalized", t->normalized},
        {"rstrip", t->rstrip},
        {"single_word", false},
        {"special", t->special}};
  }
  config["added_tokens_decoder"] = added;
  write_whole(
      fs::path(dir) / "tokenizer_config.json",
      config.dump(2, ' ', false) + "\n");
}

void Tokenizer::save_tokenizer_json(const std::string& dir) const {
  const fs::path root(dir);
  ordered_json j = ordered_json::object();
  j["version"] = "1.0";
  j["truncation"] = nullptr;
  j["padding"] = nullptr;
  ordered_json added = ordered_json::array();
  for (const auto* t : added_by_id()) {
    added.push_back(
        {{"id", t->id},
         {"content", t->content},
         {"single_word", false},
         {"lstrip", t->lstrip},
         {"rstrip", t->rstrip},
         {"normalized", t->normalized},
         {"special", t->special}});
  }
  j["added_tokens"] = added;

  const bool sp = kind_ == Kind::kSentencePiece;
  ordered_json normalizers = ordered_json::array();
  if (nfc_) {
    normalizers.push_back({{"type", "NFC"}});
  }
  if (normalizer_prepend_) {
    normalizers.push_back({{"type", "Prepend"}, {"prepend", kSpace}});
  }
  if (normalizer_replace_) {
    normalizers.push_back(
        {{"type", "Replace"},
         {"pattern", {{"String", " "}}},
         {"content", kSpace}});
  }
  j["normalizer"] = normalizers.empty()
      ? ordered_json(nullptr)
      : ordered_json{{"type", "Sequence"}, {"normalizers", normalizers}};
  auto byte_level = [](bool use_regex) {
    return ordered_json{
        {"type", "ByteLevel"},
        {"add_prefix_space", false},
        {"trim_offsets", true},
        {"use_regex", use_regex}};
  };
  if (sp) {
    j["pre_tokenizer"] = !metaspace_
        ? ordered_json(nullptr)
        : ordered_json{
              {"type", "Metaspace"},
              {"replacement", kSpace},
              {"prepend_scheme",
               prepend_ == Prepend::kAlways      ? "always"
                   : prepend_ == Prepend::kFirst ? "first"
                                                 : "never"},
              {"split", metaspace_split_}};
  } else if (split_ == Split::kGpt2 || split_ == Split::kNone) {
    j["pre_tokenizer"] = byte_level(split_ == Split::kGpt2);
  } else {
    const char* pattern = split_ == Split::kLlama3 ? kLlama3Pattern
        : split_ == Split::kQwen2                  ? kQwen2Pattern
                                                   : kBloomPattern;
    j["pre_tokenizer"] = {
        {"type", "Sequence"},
        {"pretokenizers",
         {{{"type", "Split"},
           {"pattern", {{"Regex", pattern}}},
           {"behavior", "Isolated"},
           {"invert", false}},
          byte_level(false)}}};
  }

  // TemplateProcessing of the tokens around a sequence (and, as
  // transformers writes it, around each of a pair).
  ordered_json single = ordered_json::array(), pair = ordered_json::array();
  ordered_json specials = ordered_json::object();
  auto special = [&](int64_t id, int type_id) {
    const auto& name = id_to_token(id);
    specials[name] = {
        {"id", name},
        {"ids", ordered_json::array({id})},
        {"tokens", ordered_json::array({name})}};
    return ordered_json{{"SpecialToken", {{"id", name}, {"type_id", type_id}}}};
  };
  auto sequence = [](const char* name, int type_id) {
    return ordered_json{{"Sequence", {{"id", name}, {"type_id", type_id}}}};
  };
  for (const auto id : prefix_ids_) {
    single.push_back(special(id, 0));
  }
  single.push_back(sequence("A", 0));
  for (const auto id : suffix_ids_) {
    single.push_back(special(id, 0));
  }
  for (int part = 0; part < 2; ++part) {
    for (const auto id : prefix_ids_) {
      pair.push_back(special(id, part));
    }
    pair.push_back(sequence(part == 0 ? "A" : "B", part));
    for (const auto id : suffix_ids_) {
      pair.push_back(special(id, part));
    }
  }
  j["post_processor"] = {
      {"type", "TemplateProcessing"},
      {"single", single},
      {"pair", pair},
      {"special_tokens", specials}};

  if (sp) {
    ordered_json decoders = ordered_json::array();
    if (decode_replace_) {
      decoders.push_back(
          {{"type", "Replace"},
           {"pattern", {{"String", kSpace}}},
           {"content", " "}});
    }
    if (decode_byte_fallback_) {
      decoders.push_back({{"type", "ByteFallback"}});
    }
    decoders.push_back({{"type", "Fuse"}});
    if (decode_strip_ > 0) {
      decoders.push_back(
          {{"type", "Strip"},
           {"content", " "},
           {"start", decode_strip_},
           {"stop", 0}});
    }
    j["decoder"] = {{"type", "Sequence"}, {"decoders", decoders}};
  } else {
    j["decoder"] = byte_level(true);
  }

  ordered_json vocab = ordered_json::object();
  for (size_t id = 0; id < tokens_.size(); ++id) {
    if (!tokens_[id].empty() && vocab_.count(tokens_[id])) {
      vocab[tokens_[id]] = static_cast<int64_t>(id);
    }
  }
  ordered_json merges = ordered_json::array();
  for (const auto& m : merges_) {
    merges.push_back({tokens_[m.first], tokens_[m.second]});
  }
  j["model"] = {
      {"type", "BPE"},
      {"dropout", nullptr},
      {"unk_token",
       unk_id_ >= 0 ? ordered_json(tokens_[unk_id_]) : ordered_json(nullptr)},
      {"continuing_subword_prefix", nullptr},
      {"end_of_word_suffix", nullptr},
      {"fuse_unk", fuse_unk_},
      {"byte_fallback", byte_fallback_},
      {"ignore_merges", ignore_merges_},
      {"vocab", vocab},
      {"merges", merges}};
  write_whole(root / "tokenizer.json", j.dump(1, ' ', false) + "\n");
  if (!sentencepiece_model_.empty()) {
    write_whole(root / "tokenizer.model", sentencepiece_model_);
  }

  // LlamaTokenizer rebuilds its pipeline from its options (legacy,
  // add_prefix_space) and ignores tokenizer.json's; another pipeline is
  // kept as written by the generic class.
  if (llama_pipeline_) {
    write_config(
        dir,
        "LlamaTokenizer",
        {{"legacy", prepend_ == Prepend::kAlways},
         {"add_prefix_space", prepend_ != Prepend::kNever},
         {"clean_up_tokenization_spaces", false}});
  } else {
    write_config(
        dir,
        "PreTrainedTokenizerFast",
        {{"clean_up_tokenization_spaces", false}});
  }
}

} // namespace models
} // namespace colossalai
