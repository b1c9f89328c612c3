#!/usr/bin/env python3
"""Writes the seed corpus of the tokenizer fuzzer (fuzz/corpus/tokenizer):
two small SentencePiece BPE models trained on Debian's fortunes (with and
without byte fallback, a user-defined symbol, identity normalization so the
files stay a few KB) and a text that NFC changes.

Needs sentencepiece (the test venv): .venv/bin/python fuzz/make_tokenizer_corpus.py
"""

import io
import os

import sentencepiece as spm

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "tokenizer")


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


if __name__ == "__main__":
    main()
