#!/usr/bin/env python3
"""Writes the seed corpora of the tokenizer fuzzers:
 - fuzz/corpus/tokenizer: two small SentencePiece BPE models trained on
   Debian's fortunes (with and without byte fallback, a user-defined symbol,
   identity normalization so the files stay a few KB) and a text that NFC
   changes;
 - fuzz/corpus/tokenizer_json: small tokenizer.json files as `tokenizers`
   writes them, one per pipeline we read (GPT-2's byte level with added
   tokens that strip whitespace, LLaMA 3's Split regex with a template,
   Qwen 2's with NFC, SentencePiece-style with Metaspace or the legacy
   Prepend / Replace normalizer), some followed by "\n---\n" and a
   tokenizer_config.json, as the fuzzer reads them.

Needs sentencepiece and tokenizers (the test venv):
.venv/bin/python fuzz/make_tokenizer_corpus.py
"""

import io
import json
import os
import sys

import sentencepiece as spm

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "tokenizer")
JSON_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "tokenizer_json")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
from tokenizer_reference import LLAMA3_PATTERN, QWEN2_PATTERN  # noqa: E402


def byte_level(lines, pattern=None, nfc=False, template=False):
    """A byte-level BPE of a few merges over the 256 byte tokens, with
    tokenizer_reference.py's trainer; pattern None: ByteLevel's own regex."""
    from tokenizers import AddedToken, pre_tokenizers, processors
    from tokenizer_reference import split_bpe

    tok = split_bpe(pattern or LLAMA3_PATTERN, nfc, lines, 290, ["<|endoftext|>"])
    if pattern is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.add_special_tokens([AddedToken("<mask>", lstrip=True, rstrip=True)])
    tok.add_tokens([AddedToken("[x]", rstrip=True)])
    if template:
        eot = tok.token_to_id("<|endoftext|>")
        tok.post_processor = processors.TemplateProcessing(
            single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", eot)]
        )
    return tok.to_str()


def sentencepiece_style(legacy):
    """A SentencePiece-style BPE (byte fallback) built from a few pieces."""
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    sp = "\u2581"
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += [sp, "a", "b", "c", sp + "a", "ab", sp + "ab", "bc", sp + sp]
    vocab = {p: i for i, p in enumerate(pieces)}
    merges = [(sp, "a"), ("a", "b"), (sp + "a", "b"), ("b", "c"), (sp, sp)]
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    if legacy:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(sp), normalizers.Replace(" ", sp)])
        tok.decoder = decoders.Sequence(
            [decoders.Replace(sp, " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=sp, prepend_scheme="first", split=False)
        tok.decoder = decoders.Metaspace(replacement=sp, prepend_scheme="first", split=False)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tok.to_str()


def write_json_corpus(lines):
    os.makedirs(JSON_OUT, exist_ok=True)
    llama_config = json.dumps(
        {
            "tokenizer_class": "LlamaTokenizer",
            "legacy": False,
            "add_bos_token": True,
            "eos_token": {"content": "</s>", "special": True},
            "added_tokens_decoder": {"0": {"content": "<unk>", "special": True}},
            "model_max_length": 1e30,
        }
    )
    seeds = {
        "gpt2": byte_level(lines),
        "llama3": byte_level(lines, LLAMA3_PATTERN, template=True),
        "qwen2": byte_level(lines, QWEN2_PATTERN, nfc=True),
        "metaspace": sentencepiece_style(False),
        "legacy": sentencepiece_style(True),
        "llama2": sentencepiece_style(True) + "\n---\n" + llama_config,
        "gpt2_config": byte_level(lines)
        + "\n---\n"
        + json.dumps({"eos_token": "<|endoftext|>", "pad_token": "<mask>", "model_max_length": 1024}),
    }
    for name, text in seeds.items():
        # Compact: the fuzzer's inputs are at most 16 KB.
        head, sep, tail = text.partition("\n---\n")
        text = json.dumps(json.loads(head), ensure_ascii=False, separators=(",", ":")) + sep + tail
        with open(os.path.join(JSON_OUT, name + ".json"), "w", encoding="utf-8") as f:
            f.write(text)


def main():
    os.makedirs(OUT, exist_ok=True)
    with open("/usr/share/games/fortunes/computers", encoding="utf-8") as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    for name, vocab, byte_fallback in (("bpe_byte_fallback", 420, True), ("bpe_small", 120, False)):
        out = io.BytesIO()
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_writer=out,
            model_type="bpe",
            vocab_size=vocab,
            byte_fallback=byte_fallback,
            normalization_rule_name="identity",
            user_defined_symbols=["<tool>"],
            character_coverage=0.98,
            hard_vocab_limit=False,
            num_threads=1,
            minloglevel=2,
        )
        with open(os.path.join(OUT, name + ".model"), "wb") as f:
            f.write(out.getvalue())
    # Decomposed e + acute, Hangul jamo, A + ring, an exclusion, a syllable.
    with open(os.path.join(OUT, "nfc_text"), "wb") as f:
        f.write("Cafe\u0301 \u1100\u1161 A\u030a \u0958 \ud7a3".encode())
    write_json_corpus(lines[:200])


if __name__ == "__main__":
    main()
