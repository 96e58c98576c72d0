"""Streaming a request's text as its tokens arrive (vLLM's incremental detokenization and stop
strings), for requests that report while they run (output_kind "cumulative" or "delta") or that end
on a stop string. A greedy generate() never imports this: its text is decoded once, at the end.

Each new token decodes a few tokens, not the whole completion: the tokens already turned into text
plus CONTEXT_TOKENS before them (a tokenizer may join a token to the one before it), and the text
grows by the difference. A character whose bytes span several tokens decodes to U+FFFD until its
last byte arrives: the text waits for it. While a request runs, the text it reports holds back the
end that could still become a stop string; its final text is decoded whole and cut before it.
"""
from nanovllm.core.sequence import Sequence

CONTEXT_TOKENS = 6


class Stream:
    """One sequence's text so far, and what of it has been reported."""

    def __init__(self, decode):
        self.decode = decode  # OutputProcessor.decode
        self.text = ""
        self.num_tokens = 0  # completion tokens in `text`
        self.num_reported_chars = self.num_reported_tokens = 0

    def extend(self, seq: Sequence, end: int) -> str:
        """The completion's text up to token `end`, decoding only what is new."""
        first, done = seq.num_prompt_tokens, seq.num_prompt_tokens + self.num_tokens
        start, skip = max(first, done - CONTEXT_TOKENS), seq.params.skip_special_tokens
        before = self.decode(seq.token_ids[start:done], skip)
        after = self.decode(seq.token_ids[start:end], skip)
        if not after.endswith("\ufffd"):  # a character still missing bytes waits for its next token
            self.text += after[len(before):]
            self.num_tokens = end - first
        return self.text

    def stop_string(self, seq: Sequence, end: int) -> str | None:
        """The first stop string in the text up to token `end` that the text so far did not hold."""
        old = len(self.text)
        text = self.extend(seq, end)
        hits = [(i, s) for s in seq.params.stop
                if (i := text.find(s, max(0, old - len(s) + 1))) >= 0]
        return min(hits)[1] if hits else None

    def report(self, seq: Sequence, final_text: str | None) -> tuple[str, list[int], int]:
        """(text, token ids, number of tokens reported before) for an output: everything so far with
        output_kind "cumulative", only what is new with "delta". final_text: the ended
        sequence's."""
        end = len(seq.token_ids)
        while seq.token_ids[end - 1] < 0:  # a placeholder of a step in flight (run_ahead.py)
            end -= 1
        text = final_text
        if text is None:  # still running: hold back what may become a stop string
            text = self.extend(seq, end)
            text = text[:max(0, len(text) - max(map(len, seq.params.stop), default=1) + 1)]
        chars, tokens = (self.num_reported_chars, self.num_reported_tokens) \
            if seq.params.output_kind == "delta" else (0, 0)
        self.num_reported_chars, self.num_reported_tokens = len(text), end - seq.num_prompt_tokens
        return text[chars:], seq.token_ids[seq.num_prompt_tokens + tokens:end], tokens
