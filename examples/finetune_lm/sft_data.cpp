#include "sft_data.h"

#include <c10/util/Exception.h>

#include <nlohmann/json.hpp>

#include <fstream>

namespace finetune_lm {

namespace models = colossalai::models;
using json = nlohmann::json;

namespace {

std::string at_line(const std::string& path, int64_t line) {
  return "--data '" + path + "' line " + std::to_string(line) + ": ";
}

std::string text_field(
    const json& j,
    const char* key,
    const std::string& where,
    bool required) {
  if (!j.contains(key)) {
    TORCH_CHECK(!required, where, "missing \"", key, "\"");
    return "";
  }
  TORCH_CHECK(j.at(key).is_string(), where, "\"", key, "\" must be a string");
  return j.at(key).get<std::string>();
}

} // namespace

std::vector<Conversation> read_sft_jsonl(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "cannot read --data '", path, "'");
  std::vector<Conversation> out;
  std::string text;
  int64_t line = 0;
  while (std::getline(in, text)) {
    ++line;
    if (text.find_first_not_of(" \t\r") == std::string::npos) {
      continue;
    }
    const auto where = at_line(path, line);
    json j;
    try {
      j = json::parse(text);
    } catch (const json::exception& e) {
      TORCH_CHECK(false, where, "not JSON (", e.what(), ")");
    }
    TORCH_CHECK(j.is_object(), where, "each line must be a JSON object");
    Conversation c;
    c.line = line;
    if (j.contains("messages")) {
      TORCH_CHECK(
          j.at("messages").is_array(), where, "\"messages\" must be a list");
      for (const auto& m : j.at("messages")) {
        TORCH_CHECK(
            m.is_object(),
            where,
            "each message must be an object with \"role\" and \"content\"");
        c.messages.push_back(
            {text_field(m, "role", where, true),
             text_field(m, "content", where, true)});
      }
    } else {
      TORCH_CHECK(
          j.contains("prompt") && j.contains("response"),
          where,
          "needs \"messages\", or \"prompt\" and \"response\"");
      const auto system = text_field(j, "system", where, false);
      if (!system.empty()) {
        c.messages.push_back({"system", system});
      }
      c.messages.push_back({"user", text_field(j, "prompt", where, true)});
      c.messages.push_back(
          {"assistant", text_field(j, "response", where, true)});
    }
    bool answered = false;
    for (const auto& m : c.messages) {
      answered = answered || m.role == "assistant";
    }
    TORCH_CHECK(
        answered,
        where,
        "no \"assistant\" message: nothing to train on in this example");
    out.push_back(std::move(c));
  }
  TORCH_CHECK(!out.empty(), "--data '", path, "' holds no conversation");
  return out;
}

SftBatch make_sft_sequences(
    const std::vector<Conversation>& conversations,
    const models::Tokenizer& tok,
    const models::ChatTemplate* tpl,
    int64_t seq_len,
    bool truncate,
    bool packing) {
  const int64_t width = seq_len + 1;
  const int64_t eos = tok.eos_token_id();
  const int64_t pad = eos >= 0 ? eos : 0;
  auto token = [&](int64_t id) {
    return id >= 0 ? tok.id_to_token(id) : std::string();
  };
  const auto options = models::ChatTemplateOptions()
                           .bos_token(token(tok.bos_token_id()))
                           .eos_token(token(eos));
  auto render = [&](const std::vector<models::ChatMessage>& ms, bool gen) {
    return tpl->apply(
        ms, models::ChatTemplateOptions(options).add_generation_prompt(gen));
  };
  std::vector<int64_t> all_ids, all_labels, all_positions;
  SftBatch out;
  int64_t rows = 0;
  // The sequence being filled (packing), padded and kept when full.
  std::vector<int64_t> row_ids, row_labels, row_positions;
  auto flush = [&] {
    if (row_ids.empty()) {
      return;
    }
    int64_t p = 0;
    while (static_cast<int64_t>(row_ids.size()) < width) {
      row_ids.push_back(pad);
      row_labels.push_back(-100);
      row_positions.push_back(p++); // padding: a document of its own
    }
    all_ids.insert(all_ids.end(), row_ids.begin(), row_ids.end());
    all_labels.insert(all_labels.end(), row_labels.begin(), row_labels.end());
    all_positions.insert(
        all_positions.end(), row_positions.begin(), row_positions.end());
    row_ids.clear();
    row_labels.clear();
    row_positions.clear();
    ++rows;
  };
  for (const auto& c : conversations) {
    std::vector<int64_t> ids, labels;
    auto push = [&](const std::string& text, bool trained) {
      for (auto id : tok.encode(text, /*add_special_tokens=*/false)) {
        ids.push_back(id);
        labels.push_back(trained ? id : -100);
      }
    };
    if (tpl != nullptr) {
      // Turn by turn: the prompt up to each assistant turn (its opening
      // included, as add_generation_prompt renders it) is not trained; the
      // turn itself is. The template must render each conversation's
      // prefixes as prefixes of its whole text.
      std::string done;
      std::vector<models::ChatMessage> so_far;
      for (const auto& m : c.messages) {
        if (m.role == "assistant") {
          const auto prompt = render(so_far, true);
          so_far.push_back(m);
          const auto whole = render(so_far, false);
          TORCH_CHECK(
              prompt.compare(0, done.size(), done) == 0 &&
                  whole.compare(0, prompt.size(), prompt) == 0,
              "--data line ",
              c.line,
              ": the chat template does not render this conversation turn "
              "by turn (a turn's prompt is not a prefix of the text with "
              "the answer), so the answer's tokens cannot be told apart");
          push(prompt.substr(done.size()), false);
          push(whole.substr(prompt.size()), true);
          done = whole;
        } else {
          so_far.push_back(m);
        }
      }
      const auto whole = render(so_far, false);
      if (whole.size() > done.size() &&
          whole.compare(0, done.size(), done) == 0) {
        push(whole.substr(done.size()), false); // turns after the last answer
      }
    } else {
      for (const auto& m : c.messages) {
        push(m.role + ": ", false);
        if (m.role == "assistant") {
          push(m.content, true);
          if (eos >= 0) {
            ids.push_back(eos);
            labels.push_back(eos);
          }
          push("\n", false);
        } else {
          push(m.content + "\n", false);
        }
      }
    }
    if (static_cast<int64_t>(ids.size()) > width) {
      TORCH_CHECK(
          truncate,
          "--data line ",
          c.line,
          ": the conversation is ",
          ids.size(),
          " tokens, longer than --seq-len + 1 = ",
          width,
          "; raise --seq-len or pass --truncate");
      ids.resize(width);
      labels.resize(width);
      ++out.truncated;
    }
    // Position 0 is never a target (targets are the next tokens).
    int64_t trained = 0;
    for (size_t i = 1; i < labels.size(); ++i) {
      trained += labels[i] != -100;
    }
    TORCH_CHECK(
        trained > 0,
        "--data line ",
        c.line,
        ": no assistant token is left to train on",
        truncate ? " after truncation to --seq-len" : "");
    out.trained_tokens += trained;
    ++out.conversations;
    if (static_cast<int64_t>(row_ids.size() + ids.size()) > width) {
      flush();
    }
    // A conversation's first token is never a target: in a packed sequence
    // it follows the previous conversation's last.
    labels[0] = -100;
    for (size_t i = 0; i < ids.size(); ++i) {
      row_ids.push_back(ids[i]);
      row_labels.push_back(labels[i]);
      row_positions.push_back(static_cast<int64_t>(i));
    }
    if (!packing) {
      flush();
    }
  }
  flush();
  out.ids = at::tensor(all_ids, at::kLong).view({rows, width});
  out.labels = at::tensor(all_labels, at::kLong).view({rows, width});
  if (packing) {
    out.positions = at::tensor(all_positions, at::kLong).view({rows, width});
  }
  return out;
}

} // namespace finetune_lm
