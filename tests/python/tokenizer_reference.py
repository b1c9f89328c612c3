"""transformers' / tokenizers' side of tests/test_tokenizer.cpp.

    tokenizer_reference.py make DIR
    tokenizer_reference.py check DIR CASES_JSON

make: trains a `tokenizers` ByteLevelBPETokenizer (vocab 600) on a built-in
mixed text and saves it in DIR twice: tokenizer.json, and vocab.json +
merges.txt; writes DIR/cases.json, a list of {"text", "ids"} with the ids
transformers' GPT-2 tokenizer (loaded from vocab.json + merges.txt) gives,
checked against the same tokenizer loaded from tokenizer.json.

check: loads the tokenizer the C++ side saved in DIR with AutoTokenizer and
compares its ids with CASES_JSON's (the C++ encode); prints each mismatch
and exits 1 if any.
"""

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
    print(f"{len(cases) - bad}/{len(cases)} cases agree ({type(tok).__name__}, {len(tok)} tokens)")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "make":
        make(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "check":
        check(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
