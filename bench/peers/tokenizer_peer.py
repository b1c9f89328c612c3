"""transformers' side of bench_tokenizer (bench/tokenizer.cpp).

    tokenizer_peer.py fixtures WORK CORPUS
    tokenizer_peer.py encode CORPUS DIR [DIR ...]

fixtures: the tokenizers the benchmark times, trained on CORPUS (seeded,
deterministic) and saved as transformers loads them, each in WORK/<name>:
  gpt2         byte-level BPE, 32,000 entries, GPT-2's pipeline (tokenizers)
  llama3       the same training with LLaMA 3's split regex, ignore_merges
               and a bos template
  qwen2        Qwen 2's split regex and NFC normalizer
  sentencepiece  a SentencePiece BPE of 16,000 pieces with byte fallback,
               tokenizer.model only (LlamaTokenizer, as LLaMA 2 / Mistral)

encode: for each DIR, loads the tokenizer with AutoTokenizer, encodes
CORPUS once to warm up, then once timed through the `tokenizers` backend
(encode of one string, no special tokens, as bench_tokenizer times ours);
prints one JSON line {"versions": {...}, "results": {dir: {"seconds", "ids",
"fnv"}}} (fnv: FNV-1a 64 of the ids as little-endian int64, to compare with
ours).
"""

import io
import json
import os
import sys
import time

LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")


def byte_level(work, name, text, pattern, nfc, template):
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors, trainers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(BPE(ignore_merges=name == "llama3"))
    if pattern is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|endoftext|>"]
    tok.train_from_iterator(
        [text],
        trainers.BpeTrainer(
            vocab_size=32000,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    if template:
        bos = tok.token_to_id(specials[0])
        tok.post_processor = processors.TemplateProcessing(
            single=f"{specials[0]} $A", special_tokens=[(specials[0], bos)]
        )
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=specials[0], eos_token=specials[1]).save_pretrained(
        os.path.join(work, name)
    )


def fixtures(work, corpus):
    import sentencepiece as spm

    with open(corpus, encoding="utf-8", errors="replace") as f:
        text = f.read()
    byte_level(work, "gpt2", text, None, False, False)
    byte_level(work, "llama3", text, LLAMA3, False, True)
    byte_level(work, "qwen2", text, QWEN2, True, False)
    path = os.path.join(work, "sentencepiece")
    os.makedirs(path, exist_ok=True)
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([line for line in text.splitlines() if line.strip()]),
        model_writer=out,
        model_type="bpe",
        vocab_size=16000,
        byte_fallback=True,
        num_threads=2,
        minloglevel=2,
    )
    with open(os.path.join(path, "tokenizer.model"), "wb") as f:
        f.write(out.getvalue())
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "LlamaTokenizer"}, f)


def fnv(ids):
    h = 0xCBF29CE484222325
    for i in ids:
        for b in int(i).to_bytes(8, "little", signed=True):
            h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def encode(corpus, dirs):
    from transformers import AutoTokenizer

    with open(corpus, encoding="utf-8") as f:
        text = f.read()
    result = {}
    for d in dirs:
        backend = AutoTokenizer.from_pretrained(d).backend_tokenizer
        backend.encode(text, add_special_tokens=False)
        t0 = time.perf_counter()
        ids = backend.encode(text, add_special_tokens=False).ids
        seconds = time.perf_counter() - t0
        result[d] = {"seconds": seconds, "ids": len(ids), "fnv": str(fnv(ids))}
    import tokenizers
    import transformers

    versions = {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__}
    print(json.dumps({"versions": versions, "results": result}))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "fixtures":
        fixtures(sys.argv[2], sys.argv[3])
    elif len(sys.argv) >= 4 and sys.argv[1] == "encode":
        encode(sys.argv[2], sys.argv[3:])
    else:
        sys.exit(__doc__)
