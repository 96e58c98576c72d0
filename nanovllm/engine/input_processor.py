"""Input processing (vLLM v1's processor): a request's prompt and sampling parameters, validated and
tokenized into its first Sequence, before anything is queued. A request that could never run is
refused here, with the numbers, rather than failing later inside a step it would share with other
requests: every value that lands in a step's tensors is bounded, by SamplingParams or here against
the model. A text far too long is refused by its length before it is tokenized, and nothing here
touches the engine's state, so a server may run it on a thread of its own (nanovllm/serve/)."""
import os

from nanovllm.config import Config
from nanovllm.core.sequence import Sequence, num_blocks_for
from nanovllm.sampling_params import SamplingParams

PROMPT_KEYS = {"prompt", "prompt_token_ids"}  # vLLM's prompt dicts


def load_tokenizer(model: str):
    """The model directory's tokenizer; a ValueError if it has none. A tokenizer.json is read
    without transformers (engine/tokenizer.py); a SentencePiece tokenizer.model or a vocab.json
    alone through transformers' AutoTokenizer."""
    files = ("tokenizer.json", "tokenizer.model", "vocab.json")
    if not any(os.path.isfile(os.path.join(model, f)) for f in files):
        raise ValueError(f"model={model!r} has no tokenizer ({', '.join(files)}): add one, or pass "
                         "skip_tokenizer_init=True and give prompts as token ids")
    if os.path.isfile(os.path.join(model, "tokenizer.json")):
        from nanovllm.engine.tokenizer import Tokenizer
        return Tokenizer(model)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model)


def longest_token(tokenizer) -> int:
    """The most characters a token of the vocabulary stands for, or more: a token's own string
    (byte-level BPE: a character per byte; SentencePiece: its piece) is at least as long as its
    text."""
    return max(map(len, tokenizer.get_vocab()), default=1)


class InputProcessor:
    def __init__(self, config: Config, tokenizer, num_kvcache_blocks: int):
        self.config = config
        self.tokenizer = tokenizer
        self.num_kvcache_blocks = num_kvcache_blocks
        # a text longer than this is more than max_model_len tokens: refused without tokenizing it
        longest = longest_token(tokenizer) if tokenizer is not None else 1
        self.max_prompt_chars = config.max_model_len * longest

    def make_sequence(self, prompt, params: SamplingParams | None, beam_width: int = 0) -> Sequence:
        """Validate one request and build its (root) sequence: a prompt is a string, a list of token
        ids, or vLLM's {"prompt": string} or {"prompt_token_ids": list}."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params={params!r} must be a SamplingParams")
        if isinstance(prompt, dict) and len(prompt) == 1 and prompt.keys() & PROMPT_KEYS:
            prompt = next(iter(prompt.values()))
        text = prompt if isinstance(prompt, str) else None
        if self.tokenizer is None and (params.stop or text is not None):
            what = f"stop={params.stop}" if params.stop else "a text prompt"
            raise ValueError(f"{what} needs the tokenizer: use token ids (stop_token_ids), "
                             "or drop skip_tokenizer_init")
        if text is not None and len(text) > self.max_prompt_chars:
            raise ValueError(f"prompt has {len(text)} characters: more than max_model_len="
                             f"{self.config.max_model_len} tokens can hold ({self.max_prompt_chars}"
                             " characters at most)")
        if text is not None:
            prompt = self.tokenizer.encode(text)
        if not isinstance(prompt, (list, tuple)) or not set(map(type, prompt)) <= {int}:
            raise TypeError("a prompt must be a string, a list of token ids (int) or a dict with "
                            f"'prompt' or 'prompt_token_ids', not {type(prompt).__name__}")
        vocab, max_len = self.config.hf_config["vocab_size"], self.config.max_model_len
        if not 0 < len(prompt) < max_len:
            raise ValueError(f"prompt has {len(prompt)} tokens; max_model_len={max_len} leaves "
                             f"room for prompts of 1 to {max_len - 1} (one for a new token)")
        if bad := [t for t in prompt if not 0 <= t < vocab]:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if params.logprobs is not None and params.logprobs > vocab:
            raise ValueError(f"logprobs={params.logprobs} is more than the vocabulary size {vocab}")
        if params.top_k > vocab:
            raise ValueError(f"top_k={params.top_k} must be -1 or 0 (all tokens) or an integer in "
                             f"[1, {vocab}] (the vocabulary size)")
        if bad := [t for t in params.stop_token_ids if t >= vocab]:
            raise ValueError(f"stop_token_ids={bad[:5]} are outside the vocabulary [0, {vocab})")
        width = max(params.n, beam_width)  # sequences the request may run at once
        if width > self.config.max_num_seqs:
            raise ValueError(f"the request runs {width} sequences at once (n or beam_width) but "
                             f"max_num_seqs={self.config.max_num_seqs}")
        # the worst case: preempted and recomputed, its sequences share only full prompt blocks
        block_size = self.config.kvcache_block_size
        need = width * num_blocks_for(min(len(prompt) + params.max_tokens, max_len), block_size)
        if need > self.num_kvcache_blocks:
            raise ValueError(f"the request needs {need} KV-cache blocks but the whole cache has "
                             f"{self.num_kvcache_blocks}; lower max_tokens (or n), or enlarge it")
        return Sequence(prompt, params, block_size, max_len, text)
