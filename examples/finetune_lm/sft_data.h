#pragma once

// Supervised fine-tuning data for finetune_lm: JSON lines of conversations,
// rendered with the model's chat template, the loss on the assistant's
// tokens only.

#include <colossalai/models/chat_template.h>
#include <colossalai/models/tokenizer.h>

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

namespace finetune_lm {

/// One line of an SFT file: `{"messages": [{"role", "content"}, ...]}` or
/// `{"prompt", "response"[, "system"]}`.
struct Conversation {
  std::vector<colossalai::models::ChatMessage> messages;
  int64_t line = 0; // in the file, from 1
};

/// Every conversation of `path`. A line that is not JSON, lacks the fields
/// or has no assistant turn is an error naming the file and the line; blank
/// lines are skipped.
std::vector<Conversation> read_sft_jsonl(const std::string& path);

/// Sequences of `seq_len` + 1 tokens and their targets.
struct SftBatch {
  at::Tensor ids;    // [n, seq_len + 1]
  at::Tensor labels; // [n, seq_len + 1]: the id where it is trained, else -100
  /// With packing: [n, seq_len + 1] positions, restarting at 0 with each
  /// conversation (the model keeps attention inside each); else undefined.
  at::Tensor positions;
  int64_t conversations = 0;
  int64_t truncated = 0; // conversations cut at seq_len + 1 tokens
  int64_t trained_tokens = 0;
};

/// Each conversation as one sequence: the text the chat template renders
/// (without one: "role: content" lines, each assistant turn ended by eos),
/// tokenised turn by turn so that the assistant's turns (what follows the
/// prompt `add_generation_prompt` renders) are the only labels; then
/// padded with eos (labels -100) to seq_len + 1. A longer one is an error
/// naming its line unless `truncate`, which cuts it (counted). With
/// `packing`, conversations follow each other in a sequence while they fit
/// (`positions` restart with each; its first token is never a target), and
/// only the last one's room is padded.
SftBatch make_sft_sequences(
    const std::vector<Conversation>& conversations,
    const colossalai::models::Tokenizer& tokenizer,
    const colossalai::models::ChatTemplate* chat_template,
    int64_t seq_len,
    bool truncate,
    bool packing = false);

} // namespace finetune_lm
