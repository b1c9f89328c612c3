"""transformers' side of the chat-template tests (tests/test_chat_template.cpp).

    chat_template_reference.py make DIR

Writes one tokenizer directory per template family under DIR (a small
byte-level BPE trained by `tokenizers`, with the family's special tokens,
bos / eos and chat_template, saved by transformers' PreTrainedTokenizerFast)
and DIR/cases.json: for each family and conversation, the text
`apply_chat_template(..., tokenize=False)` renders and its ids (what
`tokenize=True` gives: the text encoded without added special tokens), or
the message of the TemplateError the template raised.

The families' templates are the ones their models ship in
tokenizer_config.json (LLaMA 2 chat, Llama 3 instruct, Mistral instruct
v0.1, Qwen 2 instruct, ChatML); "whitespace" is a multi-line template of our
own with `-` markers, namespace(), a filtered loop and loop variables, which
the families' one-line templates leave untested.
"""
import json
import os
import sys

from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
from transformers import PreTrainedTokenizerFast

TEMPLATES = {
    "llama2": (
        "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
        "{% set system_message = messages[0]['content'] %}{% else %}"
        "{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
        "{% for message in loop_messages %}"
        "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
        "{% endif %}{% if loop.index0 == 0 and system_message != false %}"
        "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
        "{% else %}{% set content = message['content'] %}{% endif %}"
        "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
        "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}"
        "{% endif %}{% endfor %}",
        "<s>", "</s>", ["<s>", "</s>"]),
    "llama3": (
        "{% set loop_messages = messages %}{% for message in loop_messages %}"
        "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
        "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
        "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
        "{% endif %}",
        "<|begin_of_text|>", "<|eot_id|>",
        ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]),
    "mistral": (
        "{{ bos_token }}{% for message in messages %}"
        "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
        "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
        "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
        "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
        "{% endif %}{% endfor %}",
        "<s>", "</s>", ["<s>", "</s>"]),
    "qwen2": (
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
        "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
        "<|endoftext|>", "<|im_end|>", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]),
    "chatml": (
        "{% for message in messages %}"
        "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
        "<s>", "<|im_end|>", ["<s>", "<|im_start|>", "<|im_end|>"]),
    "whitespace": (
        "{#- a comment -#}\n"
        "{%- set ns = namespace(sys='', turns=0) %}\n"
        "{%- for m in messages %}\n"
        "    {%- if m.role == 'system' %}\n"
        "        {%- set ns.sys = m.content | trim %}\n"
        "    {%- else %}\n"
        "        {%- set ns.turns = ns.turns + 1 %}\n"
        "    {%- endif %}\n"
        "{%- endfor %}\n"
        "{{- bos_token }}\n"
        "{% if ns.sys %}\n"
        "System: {{ ns.sys }} ({{ ns.turns }} turns, {{ messages | length }} messages)\n"
        "{% endif %}\n"
        "{% for m in messages if m.role != 'system' %}\n"
        "  {{ loop.index }}/{{ loop.length }} {{ m.role | upper }}: {{ m.content }}"
        "{% if not loop.last %} |{% endif %}\n"
        "\n"
        "{% else %}\n"
        "(empty)\n"
        "{% endfor %}\n"
        "{%- if add_generation_prompt %}{{ 'ASSISTANT:' ~ ' ' * 2 ~ (messages[-1].content[:3] if messages else '') }}{% endif %}",
        "<s>", "</s>", ["<s>", "</s>"]),
}

CONVERSATIONS = [
    ([{"role": "system", "content": "You are terse."},
      {"role": "user", "content": "  Hello there!  "},
      {"role": "assistant", "content": "Hi. "},
      {"role": "user", "content": "What is 2 + 2?\nAnswer briefly."}], False),
    ([{"role": "user", "content": "Tell me a joke."}], True),
    ([{"role": "user", "content": "One"},
      {"role": "assistant", "content": "Two"}], True),
    ([{"role": "user", "content": "A"}, {"role": "user", "content": "B"}], False),
    ([{"role": "system", "content": "   "}], True),
]

CORPUS = ("You are terse. Hello there! Hi. What is 2 + 2? Answer briefly. "
          "Tell me a joke. One Two A B System user assistant turns messages "
          "You are a helpful assistant. INST SYS ASSISTANT empty ") * 4


def make(out):
    os.makedirs(out, exist_ok=True)
    cases = []
    for family, (template, bos, eos, specials) in TEMPLATES.items():
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=400, special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator([CORPUS], trainer)
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos,
                                       eos_token=eos)
        fast.chat_template = template
        d = os.path.join(out, family)
        fast.save_pretrained(d)
        fast = PreTrainedTokenizerFast.from_pretrained(d)
        for messages, gen in CONVERSATIONS:
            case = {"family": family, "messages": messages,
                    "add_generation_prompt": gen}
            try:
                text = fast.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=gen)
                case["text"] = text
                case["ids"] = fast.encode(text, add_special_tokens=False)
            except Exception as e:  # jinja2's TemplateError
                case["error"] = str(e)
            cases.append(case)
    with open(os.path.join(out, "cases.json"), "w") as f:
        json.dump(cases, f, indent=1, ensure_ascii=False)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "make":
        make(sys.argv[2])
    else:
        sys.exit(__doc__)
