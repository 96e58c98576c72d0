"""A Hugging Face tokenizer read without transformers: tokenizer.json through the `tokenizers`
library (what transformers' fast tokenizers wrap), the chat template through jinja2 in a sandbox
set up as transformers sets it up. Importing transformers took 1.7-2.1 s of an engine's 7-8 s
start on an H200 host (it checks the installed packages as it loads); this takes about 0.2 s.
A directory without a tokenizer.json still loads through transformers (input_processor.py).
"""
import json
import os
from datetime import datetime

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")
REASONING = ("reasoning_content", "thinking", "reasoning")  # a message's reasoning, by its names
# transformers' clean_up_tokenization, for tokenizers whose config asks for it
CLEAN_UP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
            (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


def token_text(value) -> str | None:
    """A special token as tokenizer_config.json gives it: a string, or an AddedToken's dict."""
    return value.get("content") if isinstance(value, dict) else value


class Tokenizer:
    """The part of transformers' PreTrainedTokenizerFast the engine and its users call: encode,
    decode, apply_chat_template, get_vocab, eos_token_id, chat_template."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer as Backend
        self.backend = Backend.from_file(os.path.join(path, "tokenizer.json"))
        config_file = os.path.join(path, "tokenizer_config.json")
        config = {}
        if os.path.isfile(config_file):
            with open(config_file) as f:
                config = json.load(f)
        special = {name: token_text(config.get(name)) for name in SPECIAL_TOKENS}
        self.special_tokens = {name: text for name, text in special.items() if text is not None}
        eos = self.special_tokens.get("eos_token")
        self.eos_token_id = self.backend.token_to_id(eos) if eos is not None else None
        # what skip_special_tokens drops beside the tokenizer's own special tokens: the config's
        self.special_ids = {self.backend.token_to_id(t) for t in self.special_tokens.values()}
        self.clean_up_spaces = config.get("clean_up_tokenization_spaces", False)
        self.chat_template = config.get("chat_template")
        if isinstance(self.chat_template, list):  # named templates: the default one
            self.chat_template = {t["name"]: t["template"] for t in self.chat_template}.get(
                "default")
        template_file = os.path.join(path, "chat_template.jinja")  # where transformers 5 saves it
        if os.path.isfile(template_file):
            with open(template_file) as f:
                self.chat_template = f.read()
        self.template = None  # compiled on first use

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids, skip_special_tokens: bool = False) -> str:
        if skip_special_tokens:
            token_ids = [t for t in token_ids if t not in self.special_ids]
        text = self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        if self.clean_up_spaces:
            for before, after in CLEAN_UP:
                text = text.replace(before, after)
        return text

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def apply_chat_template(self, conversation: list[dict], tokenize: bool = True,
                            add_generation_prompt: bool = False, **kwargs):
        """The conversation as the chat template writes it (its token ids if tokenize)."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (tokenizer_config.json's "
                             "chat_template, or chat_template.jinja)")
        if self.template is None:
            self.template = compile_template(self.chat_template)
        conversation = [with_reasoning(m) if isinstance(m, dict) else m for m in conversation]
        text = self.template.render(**{"messages": conversation, "tools": None, "documents": None,
                                       "add_generation_prompt": add_generation_prompt,
                                       **self.special_tokens, **kwargs})
        return self.encode(text, add_special_tokens=False) if tokenize else text


def with_reasoning(message: dict) -> dict:
    """A message whose reasoning comes under any of its names carries it under each (templates read
    `reasoning_content`, gpt-oss's `thinking`), as transformers passes it."""
    reasoning = next((message[k] for k in REASONING if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def compile_template(source: str):
    """A chat template compiled in jinja2's immutable sandbox, with transformers' options, filter
    and globals (tojson without HTML escapes, raise_exception, strftime_now); its `{% generation
    %}` blocks (which mark the assistant's text for training masks) render their body."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
