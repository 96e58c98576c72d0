"""Output processing (vLLM v1's output processor): whether a new token ends its sequence, the text of
the tokens, and the RequestOutputs.

A sequence ends on an end-of-sequence token (unless ignore_eos), a stop token or a stop string (not
before min_tokens), or at max_tokens or max_model_len ("length"). Text is detokenized incrementally:
each new token decodes a few tokens, not the whole completion, and a character whose bytes span
several tokens waits for its last one. While a request runs, the text it reports holds back the end
that could still become a stop string; its final text is decoded whole and cut before the stop string.
"""
import json
import os

from nanovllm.engine.sequence import Sequence
from nanovllm.outputs import CompletionOutput, RequestOutput

CONTEXT_TOKENS = 6  # decoded ahead of the new tokens: a tokenizer may join a token to the one before


def eos_token_ids(model: str, hf_config: dict, tokenizer) -> set[int]:
    """End-of-sequence ids: config.json's, generation_config.json's and the tokenizer's."""
    ids = [hf_config.get("eos_token_id"), getattr(tokenizer, "eos_token_id", None)]
    path = os.path.join(model, "generation_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            ids.append(json.load(f).get("eos_token_id"))
    return {i for x in ids for i in (x if isinstance(x, list) else [x]) if i is not None}


class OutputProcessor:
    def __init__(self, config, tokenizer):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids(config.model, config.hf_config, tokenizer)

    def check_stop(self, seq: Sequence, position: int) -> bool:
        """Whether the token at `position` (the latest known one) ends the sequence."""
        p, token = seq.params, seq.token_ids[position]
        if position + 1 - seq.num_prompt_tokens >= p.min_tokens:
            if token in self.eos_token_ids and not p.ignore_eos:
                seq.finish_reason = "stop"
            elif token in p.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
            elif p.stop:
                old = len(seq.text)
                text = self.text(seq, position + 1)
                hits = [(i, s) for s in p.stop if (i := text.find(s, max(0, old - len(s) + 1))) >= 0]
                if hits:
                    seq.finish_reason, seq.stop_reason = "stop", min(hits)[1]
        if seq.finish_reason is None and position + 1 >= seq.max_len:
            seq.finish_reason = "length"
        return seq.finish_reason is not None

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of tokens ("" without a tokenizer)."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def text(self, seq: Sequence, end: int) -> str:
        """The completion's text up to token `end`, extending what earlier calls decoded."""
        if self.tokenizer is None:
            return ""
        first, done = seq.num_prompt_tokens, seq.num_prompt_tokens + seq.num_text_tokens
        start, skip = max(first, done - CONTEXT_TOKENS), seq.params.skip_special_tokens
        before = self.decode(seq.token_ids[start:done], skip)
        after = self.decode(seq.token_ids[start:end], skip)
        if not after.endswith("\ufffd"):  # a character still missing bytes waits for its next token
            seq.text += after[len(before):]
            seq.num_text_tokens = end - first
        return seq.text

    def completion(self, seq: Sequence, index: int) -> CompletionOutput:
        """One sample: all its tokens once it ended, else those known (a step in flight excluded)."""
        first, end = seq.num_prompt_tokens, len(seq.token_ids)
        if seq.is_finished:
            text = self.decode(seq.token_ids[first:], seq.params.skip_special_tokens)
            if isinstance(seq.stop_reason, str):
                text = text[:text.find(seq.stop_reason)]
        else:
            while seq.token_ids[end - 1] < 0:  # a placeholder of a step in flight (run_ahead.py)
                end -= 1
            text = self.text(seq, end)
            text = text[:len(text) - max(map(len, seq.params.stop), default=1) + 1]  # may become a stop string
        old_chars, old_tokens = (seq.num_reported_chars, seq.num_reported_tokens) if seq.params.output_kind == "delta" \
            else (0, 0)  # with "delta", only what is new since the last report
        seq.num_reported_chars, seq.num_reported_tokens = len(text), end - first
        out = CompletionOutput(index, text[old_chars:], seq.token_ids[first + old_tokens:end],
                               finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)
        if seq.params.logprobs is not None:
            out.logprobs, out.cumulative_logprob = seq.logprobs[old_tokens:], seq.cumulative_logprob
        return out

    def output(self, root: Sequence) -> RequestOutput:
        """The request's output: each sample (all its sequences, for n > 1), finished or so far."""
        return RequestOutput(root.request_id, root.prompt, root.prompt_token_ids,
                             [self.completion(seq, i) for i, seq in enumerate(root.group)],
                             all(seq.is_finished for seq in root.group), root.num_cached_tokens, root.metrics)
