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
//  - errors name the file and the problem.

// harness/test_util.h's inline helpers use ATen's operators.
#include <ATen/ATen.h>

#include <colossalai/models/tokenizer.h>
#include <harness/test_util.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <iostream>
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

} // namespace
