"""The engine's tokenizer (engine/input_processor.py: load_tokenizer): a model directory with a
tokenizer.json loads through the fast tokenizer's class, without AutoTokenizer's imports, and it
tokenizes, decodes and formats chats as AutoTokenizer's tokenizer of the same directory does."""
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
    assert ours.all_special_ids == reference.all_special_ids


def test_tokenizer_loads_without_autotokenizer_imports(smollm2_dir):
    """AutoTokenizer's modules (and the generation code they import) stay unloaded."""
    code = ("import sys; from nanovllm.engine.input_processor import load_tokenizer; "
            f"load_tokenizer({smollm2_dir!r}); "
            "print(sorted(m for m in sys.modules if m.startswith(('transformers.models.auto', "
            "'transformers.generation'))))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip().splitlines()[-1] == "[]"
