// The tokenizer (ctest label `hf`) against transformers and `tokenizers`,
// run with the Python of the test set-up (tests/python/tokenizer_reference.py):
//  - byte-level BPE: ids equal transformers' GPT-2 tokenizer's for a
//    `tokenizers`-trained vocabulary read from tokenizer.json and from
//    vocab.json + merges.txt, decode inverts encode, a vocabulary we train
//    and save loads in transformers' AutoTokenizer with the same ids;
//  - SentencePiece BPE: for models `sentencepiece` trains, read from
//    tokenizer.model under LlamaTokenizer's options and from three
//    tokenizer.json layouts, ids with and without special tokens and
//    decode equal transformers'; what we save loads in AutoTokenizer with
//    the same ids;
//  - errors name the file and the problem;
//  - hostile files and texts (TokenizerHostile, no Python): deep JSON,
//    wrong types, ids beyond the file, FIFOs and devices, long runs of one
//    character, refused with the file and the field, or encoded in linear
//    time, each in a forked child with a deadline.

// harness/test_util.h's inline helpers use ATen's operators.
#include <ATen/ATen.h>

#include <colossalai/models/chat_template.h>
#include <colossalai/models/tokenizer.h>
#include <harness/deadline.h>
#include <harness/test_util.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace models = colossalai::models;
namespace fs = std::filesystem;
using colossalai::testing::error_of;

namespace {

const char* const kHfPython = COLOSSALAI_TEST_HF_PYTHON;

struct Scratch : colossalai::testing::ScratchDir {
  Scratch() : ScratchDir("tokenizer") {}
};

std::string quote(const std::string& s) {
  return "'" + s + "'";
}

fs::path script() {
  return fs::path(__FILE__).parent_path() / "python" / "tokenizer_reference.py";
}

struct Case {
  std::string text;
  std::vector<int64_t> ids;
};

std::vector<Case> read_cases(const std::string& file) {
  std::ifstream in(file);
  const auto j = nlohmann::json::parse(in);
  std::vector<Case> cases;
  for (const auto& c : j) {
    cases.push_back(
        {c["text"].get<std::string>(), c["ids"].get<std::vector<int64_t>>()});
  }
  return cases;
}

std::string show(const std::vector<int64_t>& ids) {
  return nlohmann::json(ids).dump();
}

// A `tokenizers`-trained vocabulary, saved both ways, and transformers'
// ids for the cases; made once per test program.
class Tokenizer : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new Scratch;
    const auto r = colossalai::testing::run_shell(
        std::string(kHfPython) + " " + quote(script().string()) + " make " +
        quote(dir_->path + "/ref"));
    ASSERT_EQ(r.first, 0) << "tokenizer_reference.py make failed (the test "
                             "set-up installs transformers: "
                             "./scripts/setup.sh --tests):\n"
                          << r.second;
    // vocab.json + merges.txt alone.
    fs::create_directories(dir_->path + "/files");
    for (const char* name : {"vocab.json", "merges.txt"}) {
      fs::copy_file(
          fs::path(dir_->path) / "ref" / name,
          fs::path(dir_->path) / "files" / name);
    }
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  static std::string ref() {
    return dir_->path + "/ref";
  }
  static std::string files() {
    return dir_->path + "/files";
  }
  static std::vector<Case> cases() {
    return read_cases(ref() + "/cases.json");
  }
  static Scratch* dir_;
};

Scratch* Tokenizer::dir_ = nullptr;

TEST_F(Tokenizer, IdsEqualTransformersFromTokenizerJson) {
  const auto tok = models::Tokenizer::from_pretrained(ref());
  const auto all = cases();
  ASSERT_GE(all.size(), 12u);
  for (const auto& c : all) {
    EXPECT_EQ(tok.encode(c.text), c.ids)
        << nlohmann::json(c.text).dump() << ": ours "
        << show(tok.encode(c.text)) << ", transformers " << show(c.ids);
  }
  EXPECT_EQ(tok.vocab_size(), 600);
  EXPECT_EQ(tok.eos_token_id(), tok.token_to_id("<|endoftext|>"));
  EXPECT_GE(tok.eos_token_id(), 0);
}

TEST_F(Tokenizer, IdsEqualTransformersFromVocabAndMerges) {
  const auto tok = models::Tokenizer::from_pretrained(files());
  for (const auto& c : cases()) {
    EXPECT_EQ(tok.encode(c.text), c.ids)
        << nlohmann::json(c.text).dump() << ": ours "
        << show(tok.encode(c.text)) << ", transformers " << show(c.ids);
  }
  EXPECT_EQ(tok.vocab_size(), 600);
  EXPECT_GE(tok.eos_token_id(), 0);
}

TEST_F(Tokenizer, DecodeInvertsEncode) {
  for (const auto& dir : {ref(), files()}) {
    const auto tok = models::Tokenizer::from_pretrained(dir);
    for (const auto& c : cases()) {
      EXPECT_EQ(tok.decode(tok.encode(c.text)), c.text)
          << dir << ": " << nlohmann::json(c.text).dump();
    }
  }
  const auto tok = models::Tokenizer::from_pretrained(ref());
  EXPECT_NE(error_of([&] { tok.decode({tok.vocab_size()}); }), "");
}

// train + save_pretrained: transformers' AutoTokenizer loads the files and
// encodes every case as our encode does.
TEST_F(Tokenizer, TrainedAndSavedLoadsInTransformers) {
  std::string text;
  for (const auto& c : cases()) {
    text += c.text + "\n";
  }
  text +=
      "The quick brown fox jumps over the lazy dog. Don't it's we'll "
      "they're 1234567890 café naïve résumé 日本語 한국어   spaces\t\ttabs";
  const auto tok = models::Tokenizer::train(text, 400);
  EXPECT_LE(tok.vocab_size(), 400);
  EXPECT_EQ(tok.eos_token_id(), tok.vocab_size() - 1);
  EXPECT_EQ(tok.id_to_token(tok.eos_token_id()), "<|endoftext|>");
  Scratch out;
  const auto dir = out.path + "/trained";
  tok.save_pretrained(dir);
  for (const char* name :
       {"vocab.json", "merges.txt", "tokenizer_config.json"}) {
    EXPECT_TRUE(fs::exists(fs::path(dir) / name)) << name;
  }
  {
    std::ifstream merges(dir + "/merges.txt");
    std::string first;
    std::getline(merges, first);
    EXPECT_EQ(first, "#version: 0.2");
  }
  // Same training, same vocabulary; reloading gives the same ids.
  const auto again = models::Tokenizer::train(text, 400);
  const auto reloaded = models::Tokenizer::from_pretrained(dir);
  nlohmann::json ours = nlohmann::json::array();
  auto all = cases();
  all.push_back({text, {}});
  for (const auto& c : all) {
    const auto ids = tok.encode(c.text);
    EXPECT_EQ(again.encode(c.text), ids);
    EXPECT_EQ(reloaded.encode(c.text), ids);
    EXPECT_EQ(tok.decode(ids), c.text);
    ours.push_back({{"text", c.text}, {"ids", ids}});
  }
  {
    std::ofstream f(out.path + "/ours.json");
    f << ours.dump();
  }
  const auto r = colossalai::testing::run_shell(
      std::string(kHfPython) + " " + quote(script().string()) + " check " +
      quote(dir) + " " + quote(out.path + "/ours.json"));
  EXPECT_EQ(r.first, 0) << r.second;
  std::cout << r.second;
}

TEST_F(Tokenizer, ErrorsNameTheFile) {
  Scratch out;
  const auto missing = out.path + "/no_such_dir";
  auto e = error_of([&] { models::Tokenizer::from_pretrained(missing); });
  EXPECT_NE(e.find(missing), std::string::npos) << e;

  const auto empty = out.path + "/empty";
  fs::create_directories(empty);
  e = error_of([&] { models::Tokenizer::from_pretrained(empty); });
  EXPECT_NE(e.find(empty), std::string::npos) << e;
  EXPECT_NE(e.find("tokenizer.json"), std::string::npos) << e;

  // A WordPiece model is not byte-level BPE.
  const auto wordpiece = out.path + "/wordpiece";
  fs::create_directories(wordpiece);
  {
    std::ifstream in(ref() + "/tokenizer.json");
    auto j = nlohmann::json::parse(in);
    j["model"]["type"] = "WordPiece";
    std::ofstream(wordpiece + "/tokenizer.json") << j.dump();
  }
  e = error_of([&] { models::Tokenizer::from_pretrained(wordpiece); });
  EXPECT_NE(e.find(wordpiece + "/tokenizer.json"), std::string::npos) << e;
  EXPECT_NE(e.find("WordPiece"), std::string::npos) << e;
  EXPECT_NE(e.find("not supported"), std::string::npos) << e;

  // Malformed JSON, and vocab.json without merges.txt.
  const auto broken = out.path + "/broken";
  fs::create_directories(broken);
  std::ofstream(broken + "/tokenizer.json") << "{\"model\": ";
  e = error_of([&] { models::Tokenizer::from_pretrained(broken); });
  EXPECT_NE(e.find(broken + "/tokenizer.json"), std::string::npos) << e;
  EXPECT_NE(e.find("malformed"), std::string::npos) << e;
  const auto half = out.path + "/half";
  fs::create_directories(half);
  fs::copy_file(files() + "/vocab.json", half + "/vocab.json");
  e = error_of([&] { models::Tokenizer::from_pretrained(half); });
  EXPECT_NE(e.find(half + "/merges.txt"), std::string::npos) << e;
  EXPECT_NE(e.find("missing"), std::string::npos) << e;

  EXPECT_NE(error_of([] { models::Tokenizer::train("abc", 100); }), "");
}

// ---------------------------------------------------------------------------
// SentencePiece BPE.

// Cases of tokenizer_reference.py's make-split / make-sentencepiece.
struct SpCase {
  std::string text;
  std::vector<int64_t> ids, ids_special;
  std::string decoded;
};

std::vector<SpCase> read_sp_cases(const std::string& dir) {
  std::ifstream in(dir + "/cases.json");
  const auto j = nlohmann::json::parse(in);
  std::vector<SpCase> cases;
  for (const auto& c : j) {
    cases.push_back(
        {c["text"].get<std::string>(),
         c["ids"].get<std::vector<int64_t>>(),
         c["ids_special"].get<std::vector<int64_t>>(),
         c["decoded"].get<std::string>()});
  }
  return cases;
}

// Our ids (without and with special tokens) and decode against the cases
// transformers wrote in `dir`.
void expect_equal(const models::Tokenizer& tok, const std::string& dir) {
  const auto cases = read_sp_cases(dir);
  ASSERT_GE(cases.size(), 29u);
  for (const auto& c : cases) {
    const auto what = dir + ": " + nlohmann::json(c.text).dump();
    EXPECT_EQ(tok.encode(c.text), c.ids)
        << what << ": ours " << show(tok.encode(c.text)) << ", transformers "
        << show(c.ids);
    EXPECT_EQ(tok.encode(c.text, true), c.ids_special)
        << what << " with special tokens: ours "
        << show(tok.encode(c.text, true)) << ", transformers "
        << show(c.ids_special);
    EXPECT_EQ(tok.decode(c.ids_special), c.decoded) << what;
  }
}

// transformers' AutoTokenizer loads what we saved in `saved` and gives our
// ids (with and without special tokens) for the texts of `cases_dir`.
void expect_transformers_agree(
    const models::Tokenizer& tok,
    const std::string& saved,
    const std::string& cases_dir) {
  nlohmann::json ours = nlohmann::json::array();
  for (const auto& c : read_sp_cases(cases_dir)) {
    ours.push_back(
        {{"text", c.text},
         {"ids", tok.encode(c.text)},
         {"ids_special", tok.encode(c.text, true)}});
  }
  std::ofstream(saved + "/ours.json") << ours.dump();
  const auto r = colossalai::testing::run_shell(
      std::string(kHfPython) + " " + quote(script().string()) + " check " +
      quote(saved) + " " + quote(saved + "/ours.json"));
  EXPECT_EQ(r.first, 0) << r.second;
  std::cout << saved << ": " << r.second;
}

// LLaMA 3's and Qwen 2's pre-tokenizer regex (byte-level BPE; Qwen 2's
// with NFC).
TEST(TokenizerSplit, Llama3AndQwen2EqualTransformers) {
  Scratch dir;
  const auto r = colossalai::testing::run_shell(
      std::string(kHfPython) + " " + quote(script().string()) + " make-split " +
      quote(dir.path));
  ASSERT_EQ(r.first, 0) << r.second;
  for (const char* variant : {"llama3", "qwen2"}) {
    SCOPED_TRACE(variant);
    const auto path = dir.path + "/" + variant;
    const auto tok = models::Tokenizer::from_pretrained(path);
    expect_equal(tok, path);
    // Saved (tokenizer.json: the regex, NFC, the template), reloaded by us
    // and by transformers.
    const auto saved = dir.path + "/saved_" + variant;
    tok.save_pretrained(saved);
    EXPECT_TRUE(fs::exists(saved + "/tokenizer.json"));
    expect_equal(models::Tokenizer::from_pretrained(saved), path);
    expect_transformers_agree(tok, saved, path);
  }
  // LLaMA 3 groups digits by three, Qwen 2 one by one; bos from the template.
  const auto llama3 = models::Tokenizer::from_pretrained(dir.path + "/llama3");
  const auto qwen2 = models::Tokenizer::from_pretrained(dir.path + "/qwen2");
  EXPECT_LT(llama3.encode("1234567").size(), qwen2.encode("1234567").size());
  EXPECT_EQ(
      llama3.encode("x", true).front(),
      llama3.token_to_id("<|begin_of_text|>"));
}

class SentencePiece : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new Scratch;
    const auto r = colossalai::testing::run_shell(
        std::string(kHfPython) + " " + quote(script().string()) +
        " make-sentencepiece " + quote(dir_->path));
    ASSERT_EQ(r.first, 0) << "tokenizer_reference.py make-sentencepiece "
                             "failed (the test set-up installs "
                             "sentencepiece and transformers: "
                             "./scripts/setup.sh --tests):\n"
                          << r.second;
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  static std::string at(const std::string& variant) {
    return dir_->path + "/" + variant;
  }
  static Scratch* dir_;
};

Scratch* SentencePiece::dir_ = nullptr;

const char* const kSentencePieceVariants[] = {
    "model",
    "model_bos",
    "model_legacy",
    "model_no_prefix",
    "model_no_bytes",
    "json",
    "json_legacy",
    "json_split",
    "json_llama2"};

TEST_F(SentencePiece, IdsAndDecodeEqualTransformers) {
  for (const char* variant : kSentencePieceVariants) {
    SCOPED_TRACE(variant);
    expect_equal(models::Tokenizer::from_pretrained(at(variant)), at(variant));
  }
  // The cases reach byte fallback, the added tokens and the bos / eos
  // template (not vacuous).
  const auto tok = models::Tokenizer::from_pretrained(at("model_bos"));
  const auto rare = tok.encode("\U0001F680");
  ASSERT_EQ(rare.size(), 5u); // "▁" and four "<0xXX>" pieces
  EXPECT_EQ(tok.id_to_token(rare[1]), "<0xF0>");
  EXPECT_EQ(tok.bos_token_id(), tok.token_to_id("<s>"));
  EXPECT_EQ(tok.eos_token_id(), tok.token_to_id("</s>"));
  EXPECT_EQ(tok.encode("a", true).front(), tok.bos_token_id());
  EXPECT_EQ(tok.encode("a", true).back(), tok.eos_token_id());
  EXPECT_EQ(
      tok.encode("<tool>"), std::vector<int64_t>{tok.token_to_id("<tool>")});
  EXPECT_EQ(
      tok.decode(tok.encode("caf\u00e9 \U0001F680 x")),
      "caf\u00e9 \U0001F680 x");
}

// What we save (tokenizer.json, tokenizer_config.json, tokenizer.model)
// loads in our reader and in transformers' AutoTokenizer with the same ids.
TEST_F(SentencePiece, SavedLoadsInTransformers) {
  Scratch out;
  for (const char* variant :
       {"model_bos",
        "model_legacy",
        "json_legacy",
        "json_split",
        "json_llama2"}) {
    SCOPED_TRACE(variant);
    const auto tok = models::Tokenizer::from_pretrained(at(variant));
    const auto dir = out.path + "/" + variant;
    tok.save_pretrained(dir);
    EXPECT_TRUE(fs::exists(dir + "/tokenizer.json"));
    EXPECT_EQ(
        fs::exists(dir + "/tokenizer.model"),
        std::string(variant).rfind("model", 0) == 0);
    const auto reloaded = models::Tokenizer::from_pretrained(dir);
    expect_equal(reloaded, at(variant));
    expect_transformers_agree(tok, dir, at(variant));
  }
}

TEST_F(SentencePiece, ErrorsNameTheFileAndTheProblem) {
  Scratch out;
  // A Unigram model (T5-style) is refused by name.
  const auto unigram = at("unigram") + "/tokenizer.model";
  auto e = error_of([&] { models::Tokenizer::from_pretrained(at("unigram")); });
  EXPECT_NE(e.find(unigram), std::string::npos) << e;
  EXPECT_NE(e.find("UNIGRAM"), std::string::npos) << e;

  // A truncated tokenizer.model, and a text file in its place.
  const auto cut = out.path + "/cut";
  fs::create_directories(cut);
  {
    std::ifstream in(at("model") + "/tokenizer.model", std::ios::binary);
    std::string data((std::istreambuf_iterator<char>(in)), {});
    std::ofstream(cut + "/tokenizer.model", std::ios::binary)
        << data.substr(0, data.size() / 2 + 3);
  }
  e = error_of([&] { models::Tokenizer::from_pretrained(cut); });
  EXPECT_NE(e.find(cut + "/tokenizer.model"), std::string::npos) << e;
  EXPECT_NE(e.find("not a SentencePiece model"), std::string::npos) << e;
  const auto text = out.path + "/text";
  fs::create_directories(text);
  std::ofstream(text + "/tokenizer.model") << "IQ== 0\nIg== 1\n";
  e = error_of([&] { models::Tokenizer::from_pretrained(text); });
  EXPECT_NE(e.find("not a SentencePiece model"), std::string::npos) << e;

  // A normalizer we do not compute is named, not ignored.
  const auto nfkc = out.path + "/nfkc";
  fs::create_directories(nfkc);
  {
    std::ifstream in(at("json_legacy") + "/tokenizer.json");
    auto j = nlohmann::json::parse(in);
    j["normalizer"]["normalizers"].push_back({{"type", "NFKC"}});
    std::ofstream(nfkc + "/tokenizer.json") << j.dump();
  }
  e = error_of([&] { models::Tokenizer::from_pretrained(nfkc); });
  EXPECT_NE(e.find(nfkc + "/tokenizer.json"), std::string::npos) << e;
  EXPECT_NE(e.find("NFKC"), std::string::npos) << e;
}

// ---------------------------------------------------------------------------
// Hostile files and texts.

using colossalai::testing::run_with_deadline;

// GPT-2's bytes_to_unicode: the vocabulary's character of each byte.
std::string byte_char(int b) {
  const bool printable =
      (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
  int cp = b;
  if (!printable) {
    cp = 256;
    for (int k = 0; k < b; ++k) {
      const bool p =
          (k >= 0x21 && k <= 0x7E) || (k >= 0xA1 && k <= 0xAC) || k >= 0xAE;
      cp += p ? 0 : 1;
    }
  }
  std::string out;
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return out;
}

// A byte-level BPE tokenizer.json: the 256 byte tokens (ids 0..255), "aa"
// (256) from the merge "a a", and an added token "<mask>" (257) that strips
// the whitespace on both sides.
nlohmann::json byte_level_json() {
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) {
    vocab[byte_char(b)] = b;
  }
  vocab["aa"] = 256;
  return {
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", {"a a"}}}},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}}},
      {"added_tokens",
       {{{"id", 257},
         {"content", "<mask>"},
         {"special", true},
         {"lstrip", true},
         {"rstrip", true}}}},
  };
}

struct TokenizerDir : Scratch {
  // Writes `name` with `text`; the directory's path.
  const std::string& with(const std::string& name, const std::string& text) {
    std::ofstream(path + "/" + name, std::ios::binary) << text;
    return path;
  }
};

// What loading `dir` (and encoding `text`) does, in a child with a deadline.
colossalai::testing::ChildOutcome load(
    const std::string& dir,
    const std::string& text = "",
    double seconds = 20) {
  return run_with_deadline(seconds, [&] {
    const auto tok = models::Tokenizer::from_pretrained(dir);
    tok.encode(text, true);
  });
}

// Refused quickly, naming `file` and each of `what`.
void expect_refused(
    const colossalai::testing::ChildOutcome& o,
    const std::string& file,
    const std::vector<std::string>& what) {
  ASSERT_TRUE(o.threw) << o.describe();
  EXPECT_NE(o.error.find(file), std::string::npos) << o.error;
  for (const auto& w : what) {
    EXPECT_NE(o.error.find(w), std::string::npos) << w << " in: " << o.error;
  }
  EXPECT_LT(o.error.size(), 1000u) << "a value dumped whole: " << o.error;
  EXPECT_LT(o.seconds, 5.0);
}

std::string nested(size_t depth) {
  return std::string(depth, '[') + std::string(depth, ']');
}

// The Split regexes `tokenizers` files spell (LLaMA 3's, Qwen 2's, Bloom's).
const char* const kLlama3Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const char* const kQwen2Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const char* const kBloomRegex =
    " ?[^(\\s|[.,!?\xE2\x80\xA6\xE3\x80\x82\xEF\xBC\x8C\xE3\x80\x81"
    "\xE0\xA5\xA4\xDB\x94\xD8\x8C])]+";

// A SentencePiece-style tokenizer.json (Metaspace, byte fallback): "▁"
// runs merge pairwise.
nlohmann::json sentencepiece_json() {
  const std::string sp = "\xE2\x96\x81";
  nlohmann::json vocab = {
      {"<unk>", 0}, {"<s>", 1}, {sp, 2}, {"a", 3}, {sp + "a", 4}, {sp + sp, 5}};
  for (int b = 0; b < 256; ++b) {
    char buf[8];
    std::snprintf(buf, sizeof buf, "<0x%02X>", b);
    vocab[buf] = 6 + b;
  }
  return {
      {"model",
       {{"type", "BPE"},
        {"vocab", vocab},
        {"merges", {sp + " a", sp + " " + sp}},
        {"byte_fallback", true},
        {"unk_token", "<unk>"}}},
      {"pre_tokenizer",
       {{"type", "Metaspace"},
        {"replacement", sp},
        {"prepend_scheme", "first"},
        {"split", false}}},
      {"decoder",
       {{"type", "Metaspace"},
        {"replacement", sp},
        {"prepend_scheme", "first"},
        {"split", false}}},
      {"added_tokens",
       {{{"id", 1}, {"content", "<s>"}, {"special", true}},
        {{"id", 0}, {"content", "<unk>"}, {"special", true}}}},
  };
}

TEST(TokenizerHostile, DeepJsonIsRefusedNotWalked) {
  for (const char* field : {"normalizer", "pre_tokenizer", "post_processor"}) {
    SCOPED_TRACE(field);
    TokenizerDir dir;
    auto text = byte_level_json().dump();
    text.insert(1, std::string("\"") + field + "\": " + nested(100000) + ", ");
    const auto o = load(dir.with("tokenizer.json", text));
    expect_refused(o, dir.path + "/tokenizer.json", {"128 levels deep"});
  }
  // In tokenizer_config.json too.
  TokenizerDir dir;
  dir.with("tokenizer.json", byte_level_json().dump());
  dir.with("tokenizer_config.json", "{\"eos_token\": " + nested(100000) + "}");
  expect_refused(
      load(dir.path), dir.path + "/tokenizer_config.json", {"levels deep"});
  // Shallow enough to parse, but not a normalizer: named, cut short.
  auto j = byte_level_json();
  j["normalizer"] = nlohmann::json::parse(nested(100));
  dir.with("tokenizer.json", j.dump());
  dir.with("tokenizer_config.json", "{}");
  expect_refused(
      load(dir.path), dir.path + "/tokenizer.json", {"normalizer", "..."});
}

TEST(TokenizerHostile, NestedSequencesAreFlattened) {
  // Sequence(Sequence(Sequence(NFC))): `tokenizers` reads it as NFC.
  auto j = byte_level_json();
  nlohmann::json n = {{"type", "NFC"}};
  for (int k = 0; k < 3; ++k) {
    n = {{"type", "Sequence"}, {"normalizers", {n}}};
  }
  j["normalizer"] = n;
  j["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       {{{"type", "Sequence"},
         {"pretokenizers",
          {{{"type", "ByteLevel"}, {"add_prefix_space", false}}}}}}}};
  TokenizerDir dir;
  const auto tok =
      models::Tokenizer::from_pretrained(dir.with("tokenizer.json", j.dump()));
  // NFC: e + combining acute is one code point, two bytes.
  EXPECT_EQ(tok.encode("e\xCC\x81").size(), 2u);
  EXPECT_EQ(tok.encode("aa"), (std::vector<int64_t>{256}));
}

TEST(TokenizerHostile, WrongTypesNameTheFileAndTheField) {
  struct Bad {
    std::function<void(nlohmann::json&)> edit;
    std::string field;
  };
  const std::vector<Bad> bad = {
      {[](auto& j) {
         j["model"]["vocab"] = {1, 2};
       },
       "'model.vocab'"},
      {[](auto& j) { j["model"]["type"] = 5; }, "'model.type'"},
      {[](auto& j) {
         j["model"]["merges"] = {{"x", 1}};
       },
       "'model.merges'"},
      {[](auto& j) { j["model"]["merges"] = {7}; }, "'model.merges[0]'"},
      {[](auto& j) { j["model"]["ignore_merges"] = "no"; },
       "'model.ignore_merges'"},
      {[](auto& j) { j["added_tokens"][0]["lstrip"] = "yes"; },
       "'added_tokens[0].lstrip'"},
      {[](auto& j) { j["added_tokens"][0]["content"] = 3; },
       "'added_tokens[0].content'"},
      {[](auto& j) { j["added_tokens"] = "x"; }, "'added_tokens'"},
      {[](auto& j) { j["pre_tokenizer"]["type"] = 7; }, "'pre_tokenizer.type'"},
      {[](auto& j) { j["pre_tokenizer"]["use_regex"] = 1; },
       "'pre_tokenizer.use_regex'"},
      {[](auto& j) {
         j["normalizer"] = {{"type", "Sequence"}, {"normalizers", "NFC"}};
       },
       "'normalizer.normalizers'"},
      {[](auto& j) {
         j["post_processor"] = {
             {"type", "TemplateProcessing"},
             {"single", {{{"SpecialToken", {{"id", "<mask>"}}}}}},
             {"special_tokens", {{"<mask>", {{"ids", {"x"}}}}}}};
       },
       "'post_processor.special_tokens.<mask>.ids[0]'"},
  };
  for (const auto& b : bad) {
    SCOPED_TRACE(b.field);
    auto j = byte_level_json();
    b.edit(j);
    TokenizerDir dir;
    expect_refused(
        load(dir.with("tokenizer.json", j.dump())),
        dir.path + "/tokenizer.json",
        {"field " + b.field});
  }
  // tokenizer_config.json's fields.
  for (const auto& [config, field] :
       std::vector<std::pair<std::string, std::string>>{
           {"{\"eos_token\": 5}", "'eos_token'"},
           {"{\"tokenizer_class\": []}", "'tokenizer_class'"},
           {"{\"model_max_length\": \"big\"}", "'model_max_length'"},
           {"{\"added_tokens_decoder\": {\"257\": {\"content\": \"<mask>\", "
            "\"special\": 1}}}",
            "'added_tokens_decoder.257.special'"}}) {
    SCOPED_TRACE(config);
    TokenizerDir dir;
    dir.with("tokenizer.json", byte_level_json().dump());
    expect_refused(
        load(dir.with("tokenizer_config.json", config)),
        dir.path + "/tokenizer_config.json",
        {"field " + field});
  }
}

TEST(TokenizerHostile, IdsAreBoundedByTheFile) {
  // One id of 1e8 in a small vocabulary: refused, not a table of 1e8.
  auto j = byte_level_json();
  j["model"]["vocab"]["aa"] = 100000000;
  TokenizerDir dir;
  expect_refused(
      load(dir.with("tokenizer.json", j.dump())),
      dir.path + "/tokenizer.json",
      {"'model.vocab'", "100000000", "from 0 to 257"});
  j = byte_level_json();
  j["added_tokens"][0]["id"] = 100000000;
  expect_refused(
      load(dir.with("tokenizer.json", j.dump())),
      dir.path + "/tokenizer.json",
      {"'added_tokens[0].id'", "100000000"});
  j = byte_level_json();
  j["post_processor"] = {
      {"type", "BertProcessing"},
      {"cls", {"<mask>", 100000000}},
      {"sep", {"<mask>", 257}}};
  expect_refused(
      load(dir.with("tokenizer.json", j.dump())),
      dir.path + "/tokenizer.json",
      {"'post_processor.cls[1]'"});
  // vocab.json + merges.txt.
  TokenizerDir files;
  files.with("merges.txt", "#version: 0.2\n");
  expect_refused(
      load(files.with("vocab.json", "{\"a\": 0, \"b\": 99999999}")),
      files.path + "/vocab.json",
      {"99999999"});
  // Added tokens beyond the vocabulary (LLaMA 3, Qwen 2) are fine.
  j = byte_level_json();
  j["added_tokens"].push_back(
      {{"id", 258}, {"content", "<x>"}, {"special", true}});
  const auto tok =
      models::Tokenizer::from_pretrained(dir.with("tokenizer.json", j.dump()));
  EXPECT_EQ(tok.vocab_size(), 259);
  EXPECT_EQ(tok.encode("<x><mask>"), (std::vector<int64_t>{258, 257}));
}

TEST(TokenizerHostile, OnlyRegularFilesAreRead) {
  for (const char* name :
       {"tokenizer.json",
        "vocab.json",
        "merges.txt",
        "tokenizer.model",
        "tokenizer_config.json"}) {
    SCOPED_TRACE(name);
    TokenizerDir dir;
    const std::string n = name;
    if (n == "vocab.json" || n == "merges.txt") {
      dir.with(n == "vocab.json" ? "merges.txt" : "vocab.json", "{}");
    } else if (n == "tokenizer_config.json") {
      dir.with("tokenizer.json", byte_level_json().dump());
    }
    // A FIFO no one writes: open() alone would block.
    const auto fifo = dir.path + "/" + n;
    ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
    expect_refused(load(dir.path), fifo, {"a FIFO, not a regular file"});
    // A device that never ends.
    fs::remove(fifo);
    fs::create_symlink("/dev/zero", fifo);
    expect_refused(load(dir.path), fifo, {"a character device"});
  }
}

// Tokenizer work is linear in the text: 200 KB of one character through
// each pipeline, and an added token with lstrip / rstrip among them (each
// match used to decode the rest of the text: minutes).
TEST(TokenizerHostile, LongRunsOfOneCharacterEncodeInLinearTime) {
  constexpr size_t kRun = 200000;
  struct Run {
    std::string name, text;
    bool round_trip; // decode(encode(text)) == text under a byte-level BPE
  };
  std::vector<Run> runs;
  // One character; combining marks of falling class (NFC reorders each
  // pair: a run sorted by swapping neighbours is quadratic).
  for (const char* c :
       {"a", " ", "\n", "'", "1", "\xC3\xA9", "\xCC\x81\xCC\x96"}) {
    std::string t;
    while (t.size() < kRun) {
      t += c;
    }
    runs.push_back(
        {nlohmann::json(c).dump(), t, std::string(c) != "\xCC\x81\xCC\x96"});
  }
  std::string masks, spaced;
  while (masks.size() < kRun) {
    masks += "<mask>";
    spaced += " <mask> ";
  }
  runs.push_back({"<mask>...", masks, false});
  runs.push_back({" <mask> ...", spaced, false});
  runs.push_back(
      {"spaces then <mask>", std::string(kRun, ' ') + "<mask>", false});
  runs.push_back(
      {"<mask> then spaces", "<mask>" + std::string(kRun, ' '), false});

  // Each pre-tokenizer, and an added token made of the run's character.
  std::vector<std::pair<std::string, nlohmann::json>> files;
  files.emplace_back("GPT-2's regex", byte_level_json());
  for (const auto& [name, regex] :
       std::vector<std::pair<std::string, std::string>>{
           {"LLaMA 3's regex", kLlama3Regex},
           {"Qwen 2's regex", kQwen2Regex},
           {"Bloom's regex", kBloomRegex}}) {
    auto j = byte_level_json();
    j["pre_tokenizer"] = {
        {"type", "Sequence"},
        {"pretokenizers",
         {{{"type", "Split"},
           {"pattern", {{"Regex", regex}}},
           {"behavior", "Isolated"},
           {"invert", false}},
          {{"type", "ByteLevel"},
           {"add_prefix_space", false},
           {"use_regex", false}}}}};
    j["normalizer"] = {{"type", "NFC"}};
    files.emplace_back(name, j);
  }
  for (const char* c : {"a", " "}) {
    auto j = byte_level_json();
    j["added_tokens"].push_back(
        {{"id", static_cast<unsigned char>(c[0])},
         {"content", c},
         {"special", false},
         {"normalized", false},
         {"lstrip", true},
         {"rstrip", true}});
    files.emplace_back(std::string("added token '") + c + "'", j);
  }
  files.emplace_back("SentencePiece", sentencepiece_json());
  double slowest = 0;
  for (const auto& [kind, j] : files) {
    TokenizerDir dir;
    dir.with("tokenizer.json", j.dump());
    const bool round_trip = kind.find("regex") != std::string::npos;
    for (const auto& r : runs) {
      SCOPED_TRACE(kind + ": " + r.name);
      const auto o = run_with_deadline(20, [&] {
        const auto tok = models::Tokenizer::from_pretrained(dir.path);
        const auto ids = tok.encode(r.text);
        if (round_trip && r.round_trip && tok.decode(ids) != r.text) {
          throw std::runtime_error("decode(encode(x)) != x");
        }
      });
      EXPECT_FALSE(o.threw || o.signal || o.timed_out) << o.describe();
      EXPECT_LT(o.seconds, 1.0);
      slowest = std::max(slowest, o.seconds);
    }
  }
  std::cout << "slowest load + encode of 200 KB: " << slowest << " s\n";
  // What the lstrip / rstrip token takes.
  TokenizerDir dir;
  const auto tok = models::Tokenizer::from_pretrained(
      dir.with("tokenizer.json", byte_level_json().dump()));
  EXPECT_EQ(tok.encode("a  <mask>  b"), (std::vector<int64_t>{97, 257, 98}));
  EXPECT_EQ(
      tok.encode(std::string(kRun, 'a')), std::vector<int64_t>(kRun / 2, 256));
}

// A SentencePiece tokenizer.model (sentencepiece_model.proto's fields).
std::string varint(uint64_t v) {
  std::string out;
  do {
    out += static_cast<char>((v & 0x7F) | (v > 0x7F ? 0x80 : 0));
    v >>= 7;
  } while (v != 0);
  return out;
}
std::string field(int number, const std::string& payload) {
  return varint(static_cast<uint64_t>(number) << 3 | 2) +
      varint(payload.size()) + payload;
}
std::string piece(const std::string& text, int type = 1) {
  return field(1, field(1, text) + varint(3 << 3) + varint(type));
}

// Merges come from splitting each piece in two (generate_merges): one walk
// per piece, where looking each split up was quadratic in its length.
TEST(TokenizerHostile, LongSentencePiecePieceLoadsInLinearTime) {
  std::string model = piece("<unk>", 2) + piece("<s>", 3) + piece("</s>", 3);
  std::string run;
  for (int k = 1; k <= 300; ++k) { // a, aa, ... : every split is a merge
    run += 'a';
    model += piece(run);
  }
  model += piece(std::string(200000, 'b')) + piece("b");
  model += field(2, varint(3 << 3) + varint(2)); // trainer_spec: BPE
  TokenizerDir dir;
  dir.with("tokenizer.model", model);
  const auto o = run_with_deadline(20, [&] {
    const auto tok = models::Tokenizer::from_pretrained(dir.path);
    // a^300 is one piece: merged from a^k + a^(300-k).
    if (tok.encode(std::string(300, 'a')).size() != 1) {
      throw std::runtime_error("a^300 is not one piece");
    }
  });
  EXPECT_FALSE(o.threw || o.signal || o.timed_out) << o.describe();
  EXPECT_LT(o.seconds, 1.0);
}

// Chat templates (NOTE [Chat templates]): the five families' templates and
// a multi-line one of our own render what transformers' apply_chat_template
// renders, string for string and id for id (the text encoded by the
// family's tokenizer, without added special tokens), and raise the same
// messages; what lies outside the subset is refused by name when read.
class ChatTemplates : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new Scratch;
    const auto r = colossalai::testing::run_shell(
        std::string(kHfPython) + " " +
        quote((fs::path(__FILE__).parent_path() / "python" /
               "chat_template_reference.py")
                  .string()) +
        " make " + quote(dir_->path));
    ASSERT_EQ(r.first, 0) << "chat_template_reference.py make failed:\n"
                          << r.second;
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  static Scratch* dir_;
};

Scratch* ChatTemplates::dir_ = nullptr;

TEST_F(ChatTemplates, RenderAsTransformersStringForStringAndIdForId) {
  std::ifstream in(dir_->path + "/cases.json");
  const auto cases = nlohmann::json::parse(in);
  std::map<std::string, int> checked;
  for (const auto& c : cases) {
    const auto family = c["family"].get<std::string>();
    SCOPED_TRACE(family + " " + c["messages"].dump());
    const auto dir = dir_->path + "/" + family;
    const auto tok = models::Tokenizer::from_pretrained(dir);
    const auto tpl = models::ChatTemplate::from_pretrained(dir);
    std::vector<models::ChatMessage> messages;
    for (const auto& m : c["messages"]) {
      messages.push_back(
          {m["role"].get<std::string>(), m["content"].get<std::string>()});
    }
    const bool gen = c["add_generation_prompt"].get<bool>();
    if (c.contains("error")) {
      const auto e = error_of(
          [&] { models::apply_chat_template(tok, tpl, messages, gen); });
      EXPECT_EQ(e, c["error"].get<std::string>());
    } else {
      const auto text = tpl.apply(
          messages,
          models::ChatTemplateOptions()
              .add_generation_prompt(gen)
              .bos_token(tok.id_to_token(tok.bos_token_id()))
              .eos_token(tok.id_to_token(tok.eos_token_id())));
      EXPECT_EQ(text, c["text"].get<std::string>());
      EXPECT_EQ(
          show(models::apply_chat_template(tok, tpl, messages, gen)),
          show(c["ids"].get<std::vector<int64_t>>()));
    }
    ++checked[family];
  }
  for (const char* f :
       {"llama2", "llama3", "mistral", "qwen2", "chatml", "whitespace"}) {
    EXPECT_EQ(checked[f], 5) << f;
  }
}

TEST_F(ChatTemplates, WhatIsOutsideTheSubsetIsRefusedByName) {
  auto refused = [](const std::string& source, const std::string& part) {
    const auto e = error_of([&] { models::ChatTemplate t(source); });
    EXPECT_NE(e.find(part), std::string::npos) << source << " -> " << e;
  };
  refused("{% macro f() %}x{% endmacro %}", "'{% macro %}' is outside");
  refused("{{ x | wordwrap }}", "the filter 'wordwrap' is outside");
  refused("{{ x is callable }}", "the test 'callable' is outside");
  refused("{{ cycler(1, 2) }}", "the function 'cycler' is outside");
  refused("{{ m.format(1) }}", "the method 'format' is outside");
  refused("{% for m in messages %}x", "has no '{% endfor %}'");
  refused("{% if x %}x", "has no '{% endif %}'");
  refused("{{ 'unterminated }}", "unterminated string");
  refused("a {{ x", "unclosed '{{' at line 1, column 3");
  refused("{% endfor %}", "unexpected '{% endfor %}'");
  // Errors while rendering name the operation.
  const auto e =
      error_of([] { models::ChatTemplate("{{ 'a' + 1 }}").apply({}); });
  EXPECT_NE(e.find("unsupported operand types for +"), std::string::npos) << e;
}

TEST(ChatTemplate, PythonSemanticsOfTheSubset) {
  auto render = [](const std::string& source) {
    return models::ChatTemplate(source).apply(
        {{"user", "Hi"}, {"assistant", "Yo"}});
  };
  EXPECT_EQ(
      render("{{ -7 // 2 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** 10 }}"),
      "-4 2 3.5 1024");
  EXPECT_EQ(
      render("{{ [1, 2, 3][::-1] }} {{ 'abcdef'[1:-1:2] }}"), "[3, 2, 1] bd");
  EXPECT_EQ(
      render("{{ none }} {{ true }} {{ {'a': 1} }} {{ undefined_name }}"),
      "None True {'a': 1} ");
  EXPECT_EQ(
      render("{{ 'x' if false }}|{{ 1 == true }}|{{ 'a' in 'cat' }}"),
      "|True|True");
  EXPECT_EQ(
      render("{% for r, c in [['a', 1], ['b', 2]] %}{{ r }}{{ c }}"
             "{% endfor %}"),
      "a1b2");
  EXPECT_EQ(
      render("{{ messages[0].content ~ messages[-1]['content'] }}"), "HiYo");
  EXPECT_EQ(
      render("{{ messages | tojson }}"),
      "[{\"role\": \"user\", \"content\": \"Hi\"}, "
      "{\"role\": \"assistant\", \"content\": \"Yo\"}]");
  EXPECT_EQ(render("  {% if true %}\n  x\n  {% endif %}\n"), "  x\n");
}

} // namespace
