"""The engine's tokenizer (engine/tokenizer.py, loaded by engine/input_processor.py's
load_tokenizer): a model directory with a tokenizer.json loads without importing transformers,
and it tokenizes, decodes and formats chats as transformers' AutoTokenizer of the same directory
does."""
import json
import os
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from nanovllm.engine.input_processor import load_tokenizer

TEXTS = ["Hello world!", " a leading space", "<|im_start|>user\nHi<|im_end|>\n",
         "Ünïcödé 日本語 🙂", "a\n\n\tb   c", "it's   we'll 123 4567"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


def qwen2_tokenizer_dir(smollm2_dir: str, path: str) -> str:
    """A Qwen2Tokenizer directory (Qwen3's tokenizer class) over SmolLM2's byte-level BPE."""
    from transformers import Qwen2Tokenizer
    model = json.load(open(os.path.join(smollm2_dir, "tokenizer.json")))["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    template = AutoTokenizer.from_pretrained(smollm2_dir).chat_template
    Qwen2Tokenizer(vocab=model["vocab"], merges=merges, eos_token="<|im_end|>",
                   pad_token="<|endoftext|>", chat_template=template).save_pretrained(path)
    return path


@pytest.mark.parametrize("kind", ["smollm2", "qwen2"])
def test_tokenizer_matches_autotokenizer(smollm2_dir, tmp_path, kind):
    path = smollm2_dir if kind == "smollm2" else qwen2_tokenizer_dir(smollm2_dir, str(tmp_path))
    ours, reference = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
    for text in TEXTS:
        ids = reference.encode(text)
        assert ours.encode(text) == ids, text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(
                ids, skip_special_tokens=skip)
    assert ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == \
        reference.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert ours.eos_token_id == reference.eos_token_id
    assert ours.get_vocab() == reference.get_vocab()


# a template that uses what transformers gives templates: loop controls, namespace, tojson,
# raise_exception, {% generation %} blocks, the special tokens, a reasoning field's other names
TEMPLATE = """{{ bos_token }}{% set ns = namespace(n=0) %}{% for m in messages %}
{% if m.role not in ('user', 'assistant') %}{{ raise_exception('roles alternate') }}{% endif %}
{% if loop.index > 3 %}{% break %}{% endif %}{% set ns.n = ns.n + 1 %}
{% if m.role == 'assistant' %}{% generation %}A: {{ m.thinking }} {{ m.reasoning_content }}
{{ m.content }}{{ eos_token }}{% endgeneration %}
{% else %}U: {{ m.content | tojson }} {{ m | tojson(indent=1) }}
{% endif %}{% endfor %}{{ ns.n }}{% if add_generation_prompt %}A:{% endif %}"""


def word_level_dir(path: str) -> str:
    """A word-level tokenizer of our own: a BOS token added to every encoding, spaces before
    punctuation cleaned up in decoding (clean_up_tokenization_spaces), special tokens given as
    AddedToken dicts, the template above."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    words = ["<unk>", "<s>", "</s>", "hello", "world", ",", ".", "don", "'", "t", "?", "it", "s"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(os.path.join(path, "tokenizer.json"))
    names = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    special = {name: {"__type": "AddedToken", "content": text, "special": True}
               for name, text in names.items()}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": TEMPLATE,
                   "clean_up_tokenization_spaces": True, **special}, f)
    return path


def test_tokenizer_of_our_own_matches_autotokenizer(tmp_path):
    path = word_level_dir(str(tmp_path))
    ours, reference = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
    for text in ["hello , world .", "don ' t it ' s ?", "hello unknown world", ""]:
        ids = reference.encode(text)
        assert ours.encode(text) == ids and ids[:1] == [1], text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(
                ids, skip_special_tokens=skip)
    chats = [[{"role": "user", "content": "Hi \"there\" <b>"}],
             [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b",
                                                 "reasoning": "because"}],
             [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}] * 3]
    for conversation in chats:
        for prompt in (True, False):
            assert ours.apply_chat_template(conversation, tokenize=False,
                                            add_generation_prompt=prompt) == \
                reference.apply_chat_template(conversation, tokenize=False,
                                              add_generation_prompt=prompt)
    with pytest.raises(Exception, match="roles alternate"):
        ours.apply_chat_template([{"role": "system", "content": "x"}], tokenize=False)
    assert ours.eos_token_id == reference.eos_token_id == 2


def test_tokenizer_loads_without_transformers(smollm2_dir):
    """Neither loading the tokenizer nor using it imports transformers (1.7-2.1 s of a start)."""
    code = ("import sys; from nanovllm.engine.input_processor import load_tokenizer; "
            f"t = load_tokenizer({smollm2_dir!r}); t.decode(t.apply_chat_template("
            "[{'role': 'user', 'content': 'Hi'}])); "
            "print(sorted(m for m in sys.modules if m.startswith('transformers')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip().splitlines()[-1] == "[]"
