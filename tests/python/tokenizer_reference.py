"""transformers' / tokenizers' side of tests/test_tokenizer.cpp.

    tokenizer_reference.py make DIR
    tokenizer_reference.py make-split DIR
    tokenizer_reference.py make-sentencepiece DIR
    tokenizer_reference.py check DIR CASES_JSON
    tokenizer_reference.py llama-dir DIR CORPUS
    tokenizer_reference.py qwen2-dir DIR CORPUS

make: trains a `tokenizers` ByteLevelBPETokenizer (vocab 600) on a built-in
mixed text and saves it in DIR twice: tokenizer.json, and vocab.json +
merges.txt; writes DIR/cases.json, a list of {"text", "ids"} with the ids
transformers' GPT-2 tokenizer (loaded from vocab.json + merges.txt) gives,
checked against the same tokenizer loaded from tokenizer.json.

make-split: byte-level BPEs with LLaMA 3's and Qwen 2's Split regex (and
ByteLevel without its own), trained by `tokenizers` on the same text, in
DIR/llama3 (ignore_merges, a "<|begin_of_text|>" template) and DIR/qwen2
(an NFC normalizer, as Qwen 2's), each with added tokens that take the
whitespace beside them ("<mask>" both sides, "[x]" after it, normalized)
and its cases.json as make-sentencepiece writes them.

make-sentencepiece: trains SentencePiece BPE models (`sentencepiece`, with
and without byte fallback, with a user-defined and a control symbol) on the
same text and writes one directory per way transformers reads them, each
with its cases.json ({"text", "ids", "ids_special", "decoded"}: ids without
and with special tokens, decode of the latter):
  model            tokenizer.model (LlamaTokenizer's defaults)
  model_bos        ... add_bos_token / add_eos_token
  model_legacy     ... legacy=true (a "▁" before each piece of text)
  model_no_prefix  ... add_prefix_space=false
  model_no_bytes   a model trained without byte fallback (unknown code
                   points are dropped, as transformers does)
  json             tokenizer.json as transformers saves model_bos
  json_legacy      a tokenizer.json of the older LLaMA layout: normalizer
                   Prepend("▁") + Replace(" ", "▁"), no pre-tokenizer,
                   unk_token, bos only
  json_split       Metaspace split=true, prepend "always", unk_token
  json_llama2      json_legacy's tokenizer.json with tokenizer_class
                   LlamaTokenizer, as LLaMA 2 ships: transformers then
                   ignores the file's normalizer / pre-tokenizer / decoder
                   and builds LlamaTokenizer's (here legacy=false)
  unigram          a Unigram tokenizer.model (refused by the C++ side)

llama-dir: a LLaMA directory as transformers writes one, with a
SentencePiece BPE (vocab 512, byte fallback) trained on CORPUS as its only
tokenizer file (tokenizer.model, add_bos_token) and a small random
LlamaForCausalLM (seeded) for it.

qwen2-dir: a Qwen 2 directory: a byte-level BPE (vocab 512) with Qwen 2's
pipeline (NFC, its split regex) trained on CORPUS by `tokenizers`, saved by
transformers as tokenizer.json, and a small random Qwen2ForCausalLM with
tied embeddings.

check: loads the tokenizer the C++ side saved in DIR with AutoTokenizer and
compares its ids with CASES_JSON's (the C++ encode; "ids_special" too where
given); prints each mismatch and exits 1 if any.
"""

import io
import json
import os
import shutil
import sys
import tempfile

from tokenizers import ByteLevelBPETokenizer
from transformers import AutoTokenizer, GPT2TokenizerFast, PreTrainedTokenizerFast

TRAIN_TEXT = """\
The quick brown fox jumps over the lazy dog. It's 12:45 and we'll see; don't worry!
She said: "I can't, won't, and shouldn't." They're here, you've seen it, I'm sure, he'd go.
Numbers: 0 1 2 3 42 123 4567 89012 3.14159 2,718 -7 +8 100% $20 #1 @home
Multiple   spaces    between     words.  Two  spaces.
Tabs\tare\there\t\tand trailing spaces   
Newlines

and blank lines


Café, naïve, résumé, façade, coöperate, Ångström, Straße, piñata, œuvre.
日本語のテキスト、中文文本。한국어 텍스트.
Ελληνικά κείμενα και русский текст, also العربية.
Emoji 🙂 and symbols © ® ™ € £ ¥ ½ ¼ ² ³ µ ª º.
The the THE tHe thE; the end. Don't DON'T it's IT'S we'll WE'LL.
"""

CASES = [
    "Hello world",
    " Hello world",
    "Hello world ",
    "  multiple   spaces  here",
    "\n\n",
    "line one\nline two\n\nline four\n",
    "tabs\tand\t\tmore\t",
    "12345 and 3.14159, 1000000",
    "don't, it's, we'll, they're, I'm, you've, he'd",
    "DON'T IT'S 'S 's",
    "café naïve résumé Straße",
    "日本語のテキスト 中文 한국어",
    "Emoji 🙂!! ½ ² µ ª",
    "   ",
    "",
    "a  b   c\t \n d",
    "x<|endoftext|>y",
    "mixed123abc!?...---",
    "Ελληνικά русский العربية ١٢٣",
]


def make(d):
    os.makedirs(d, exist_ok=True)
    tok = ByteLevelBPETokenizer(add_prefix_space=False)
    tok.train_from_iterator(
        [TRAIN_TEXT] * 3,
        vocab_size=600,
        min_frequency=1,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    tok.save(os.path.join(d, "tokenizer.json"))
    tok.save_model(d)  # vocab.json, merges.txt
    # vocab.json + merges.txt alone (from_pretrained would prefer
    # tokenizer.json next to them).
    with tempfile.TemporaryDirectory() as files:
        for name in ("vocab.json", "merges.txt"):
            shutil.copy(os.path.join(d, name), files)
        ref = GPT2TokenizerFast.from_pretrained(files)
    ref_json = PreTrainedTokenizerFast(tokenizer_file=os.path.join(d, "tokenizer.json"))
    cases = []
    for text in CASES:
        ids = ref.encode(text, add_special_tokens=False)
        ids_json = ref_json.encode(text, add_special_tokens=False)
        if ids != ids_json:
            sys.exit(f"vocab.json+merges.txt and tokenizer.json disagree on {text!r}: {ids} vs {ids_json}")
        cases.append({"text": text, "ids": ids})
    with open(os.path.join(d, "cases.json"), "w", encoding="utf-8") as f:
        json.dump(cases, f, ensure_ascii=False, indent=1)


SENTENCEPIECE_CASES = CASES + [
    "<s>hello",
    "hi <s> there",
    "<s>",
    "</s> after",
    "a<tool>b <tool> c",
    "x <ctrl>y",
    "\u2581already marked",
    " leading space",
    "trailing  ",
    "rare: \u0444\u044b\u0432 \u2603 \U0001F680 \u00e9\u00e8",
    "The quick brown fox. The the THE.",
    "def f():\n    return x\n        if y:   z",
]


INDENTED = ["    return x", "        if y:", "            z = 1", "    def f(a, b):", "  -  item"]


def train_sentencepiece(model_type, byte_fallback):
    """With byte fallback, whitespace-only pieces ("▁▁", as LLaMA has); without,
    pieces across spaces (split_by_whitespace=false: "▁" inside a piece)."""
    import sentencepiece as spm

    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        # Indented lines, for pieces of spaces.
        sentence_iterator=iter(TRAIN_TEXT.splitlines() * 3 + INDENTED * 20),
        model_writer=out,
        model_type=model_type,
        vocab_size=500,
        byte_fallback=byte_fallback,
        character_coverage=0.98,  # some code points only by byte fallback
        user_defined_symbols=["<tool>"],
        control_symbols=["<ctrl>"],
        allow_whitespace_only_pieces=byte_fallback,
        remove_extra_whitespaces=False,
        split_by_whitespace=byte_fallback,
        hard_vocab_limit=False,
        num_threads=1,
        minloglevel=2,
    )
    return out.getvalue()


def write_cases(tok, d, texts=None):
    cases = []
    for text in texts or SENTENCEPIECE_CASES:
        ids_special = tok(text)["input_ids"]
        cases.append(
            {
                "text": text,
                "ids": tok(text, add_special_tokens=False)["input_ids"],
                "ids_special": ids_special,
                "decoded": tok.decode(ids_special),
            }
        )
    with open(os.path.join(d, "cases.json"), "w", encoding="utf-8") as f:
        json.dump(cases, f, ensure_ascii=False, indent=1)
    return cases


LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")

SPLIT_CASES = CASES + [
    "1234567 89 12 3",
    "Hello\n\n  world\n",
    "'S 'LL 'Re 'VE 'm 'D 'x",
    "x\r\ny\r\n\r\n z",
    "\u017f'\u017f '\u017f",
    "  \n  \n x  ",
    "!!!\n\nabc ...\n",
    "e\u0301a a\u0301b \u0301",
    "\tab \u00a0nbsp \u3000ideographic",
    "<|begin_of_text|>hi<|end_of_text|>",
    "\u212b \u1100\u1161\u11a8 \u0958 \u1e0b\u0323 \u0344 \uf900",
    "Cafe\u0301 cafe\u0301 CAFE\u0301",
    # Added tokens that take the whitespace beside them.
    "a  <mask>  b",
    "<mask><mask> <mask>\n\n<mask>",
    "x [x]   y [x]\t\n[x]",
    "  <mask>",
    "<mask>  \n",
    "<mask>" * 20 + " " * 30 + "[x]" * 5 + "\u3000 z",
]


def split_bpe(pattern, nfc, texts, vocab_size, specials, ignore_merges=False):
    """A byte-level BPE with a Split regex (and NFC), trained on `texts`."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE

    tok = Tokenizer(BPE(ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    return tok


# The small random models of llama-dir and qwen2-dir.
TINY_MODEL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def make_split(d):
    from tokenizers import AddedToken, processors

    for name, pattern, ignore_merges in (("llama3", LLAMA3_PATTERN, True), ("qwen2", QWEN2_PATTERN, False)):
        path = os.path.join(d, name)
        os.makedirs(path, exist_ok=True)
        specials = ["<|begin_of_text|>", "<|end_of_text|>"]
        tok = split_bpe(pattern, name == "qwen2", [TRAIN_TEXT] * 3, 700, specials, ignore_merges)
        tok.add_special_tokens([AddedToken("<mask>", lstrip=True, rstrip=True)])
        tok.add_tokens([AddedToken("[x]", rstrip=True)])
        bos = tok.token_to_id(specials[0])
        tok.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single=f"{specials[0]} $A" if name == "llama3" else "$A",
                    pair=f"{specials[0]} $A {specials[0]} $B" if name == "llama3" else "$A $B",
                    special_tokens=[(specials[0], bos)],
                ),
            ]
        )
        ref = PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token=specials[0], eos_token=specials[1]
        )
        ref.save_pretrained(path)
        write_cases(AutoTokenizer.from_pretrained(path), path, SPLIT_CASES)


def make_sentencepiece(d):
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    os.makedirs(d, exist_ok=True)
    with_bytes = train_sentencepiece("bpe", True)
    without_bytes = train_sentencepiece("bpe", False)

    def model_dir(name, data, config):
        path = os.path.join(d, name)
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "tokenizer.model"), "wb") as f:
            f.write(data)
        with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "LlamaTokenizer", **config}, f)
        tok = AutoTokenizer.from_pretrained(path)
        write_cases(tok, path)
        return tok

    model_dir("model", with_bytes, {})
    bos = model_dir("model_bos", with_bytes, {"add_bos_token": True, "add_eos_token": True})
    model_dir("model_legacy", with_bytes, {"legacy": True})
    model_dir("model_no_prefix", with_bytes, {"add_prefix_space": False})
    model_dir("model_no_bytes", without_bytes, {})

    # tokenizer.json as transformers writes it (the tokenizer.model beside
    # it removed: the C++ side must read the JSON).
    path = os.path.join(d, "json")
    bos.save_pretrained(path)
    if os.path.exists(os.path.join(path, "tokenizer.model")):
        os.remove(os.path.join(path, "tokenizer.model"))
    write_cases(AutoTokenizer.from_pretrained(path), path)

    # The same vocabulary and merges in other tokenizer.json layouts.
    spec = json.loads(bos.backend_tokenizer.to_str())["model"]
    vocab, merges = spec["vocab"], [tuple(m) for m in spec["merges"]]

    def json_dir(name, tokenizer):
        path = os.path.join(d, name)
        os.makedirs(path, exist_ok=True)
        ref = PreTrainedTokenizerFast(
            tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
        )
        ref.save_pretrained(path)
        auto = AutoTokenizer.from_pretrained(path)
        cases = write_cases(ref, path)
        for c in cases:
            got = auto(c["text"])["input_ids"]
            if got != c["ids_special"]:
                sys.exit(f"{name}: AutoTokenizer and the tokenizer.json disagree on {c['text']!r}: {got} vs {c['ids_special']}")

    legacy = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    legacy.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    legacy.pre_tokenizer = None
    legacy.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    legacy.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    legacy.add_special_tokens(["<unk>", "<s>", "</s>", "<ctrl>"])
    legacy.add_tokens(["<tool>"])
    json_dir("json_legacy", legacy)

    path = os.path.join(d, "json_llama2")
    os.makedirs(path, exist_ok=True)
    shutil.copy(os.path.join(d, "json_legacy", "tokenizer.json"), path)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "LlamaTokenizer", "legacy": False, "add_bos_token": True}, f)
    write_cases(AutoTokenizer.from_pretrained(path), path)

    split = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=False))
    split.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    split.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    split.add_special_tokens(["<unk>", "<s>", "</s>", "<ctrl>"])
    split.add_tokens(["<tool>"])
    json_dir("json_split", split)

    path = os.path.join(d, "unigram")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "tokenizer.model"), "wb") as f:
        f.write(train_sentencepiece("unigram", True))


def llama_dir(d, corpus):
    import sentencepiece as spm
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    os.makedirs(d, exist_ok=True)
    with open(corpus, encoding="utf-8", errors="replace") as f:
        lines = [line for line in f.read().splitlines() if line.strip() and line != "%"]
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=out,
        model_type="bpe",
        vocab_size=512,
        byte_fallback=True,
        num_threads=1,
        minloglevel=2,
    )
    with open(os.path.join(d, "tokenizer.model"), "wb") as f:
        f.write(out.getvalue())
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "LlamaTokenizer", "add_bos_token": True}, f)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, bos_token_id=1, eos_token_id=2, **TINY_MODEL)
    LlamaForCausalLM(config).save_pretrained(d)


def qwen2_dir(d, corpus):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with open(corpus, encoding="utf-8", errors="replace") as f:
        text = f.read()
    tok = split_bpe(QWEN2_PATTERN, True, [text], 512, ["<|endoftext|>"])
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(d)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=tok.get_vocab_size(), tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, **TINY_MODEL
    )
    Qwen2ForCausalLM(config).save_pretrained(d)


def check(d, cases_json):
    tok = AutoTokenizer.from_pretrained(d)
    with open(cases_json, encoding="utf-8") as f:
        cases = json.load(f)
    bad = 0
    for case in cases:
        ids = tok.encode(case["text"], add_special_tokens=False)
        if ids != case["ids"]:
            bad += 1
            print(f"mismatch for {case['text']!r}: transformers {ids}, ours {case['ids']}")
        if "ids_special" in case and tok(case["text"])["input_ids"] != case["ids_special"]:
            bad += 1
            print(
                f"mismatch with special tokens for {case['text']!r}: transformers "
                f"{tok(case['text'])['input_ids']}, ours {case['ids_special']}"
            )
    print(f"{len(cases) - bad}/{len(cases)} cases agree ({type(tok).__name__}, {len(tok)} tokens)")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "make":
        make(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "llama-dir":
        llama_dir(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 4 and sys.argv[1] == "qwen2-dir":
        qwen2_dir(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 3 and sys.argv[1] == "make-split":
        make_split(sys.argv[2])
    elif len(sys.argv) == 3 and sys.argv[1] == "make-sentencepiece":
        make_sentencepiece(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "check":
        check(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
