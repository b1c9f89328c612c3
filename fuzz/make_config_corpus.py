#!/usr/bin/env python3
"""Writes the seed corpus of the config.json fuzzer (fuzz/corpus/config): the
config.json transformers writes for a small model of every family
from_pretrained reads (GPT-2, LLaMA 3 with its rope scaling, Mistral,
Qwen2, Qwen3, OPT, BLOOM, BERT), and a few hostile ones (nesting, wrong
types, fields out of range).

Needs transformers (the test venv): .venv/bin/python fuzz/make_config_corpus.py
"""

import os

import transformers as tf

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "config")

SMALL = dict(vocab_size=100, hidden_size=32, intermediate_size=64,
             num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=32)


def configs():
    yield "gpt2", tf.GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    yield "llama3", tf.LlamaConfig(
        **SMALL, num_key_value_heads=2,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    yield "mistral", tf.MistralConfig(**SMALL, num_key_value_heads=2, sliding_window=8)
    yield "qwen2", tf.Qwen2Config(**SMALL, num_key_value_heads=2)
    yield "qwen3", tf.Qwen3Config(**SMALL, num_key_value_heads=2, head_dim=8)
    yield "opt", tf.OPTConfig(vocab_size=100, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                              num_attention_heads=4, max_position_embeddings=32,
                              word_embed_proj_dim=16)
    yield "bloom", tf.BloomConfig(vocab_size=100, hidden_size=32, n_layer=2, n_head=4)
    yield "bert", tf.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                num_attention_heads=4, intermediate_size=64,
                                max_position_embeddings=32)


HOSTILE = {
    "gpt2_zero_heads": '{"model_type": "gpt2", "n_head": 0, "n_layer": 1}',
    "gpt2_float_layers": '{"model_type": "gpt2", "n_layer": 2.5}',
    "llama_rope_theta": '{"model_type": "llama", "rope_theta": -1, "num_hidden_layers": 1}',
    "llama_kv_heads": '{"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 3}',
    "bloom_alias": '{"model_type": "bloom", "n_embed": 30, "num_attention_heads": 4}',
    "nested": '{"model_type": "opt", "dropout": ' + "[" * 80 + "]" * 80 + "}",
    "wrong_types": '{"model_type": "bert", "pad_token_id": "0", "is_decoder": "false"}',
}


def main():
    os.makedirs(OUT, exist_ok=True)
    for name, config in configs():
        with open(os.path.join(OUT, name + ".json"), "w") as f:
            f.write(config.to_json_string())
    for name, text in HOSTILE.items():
        with open(os.path.join(OUT, name + ".json"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
