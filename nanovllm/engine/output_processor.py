"""Output processing (vLLM v1's output processor): whether a new token ends its sequence, and the
RequestOutputs. A sequence ends on an end-of-sequence token (unless ignore_eos), a stop token or a
stop string (not before min_tokens), or at max_tokens or max_model_len ("length"). The text of an
ended sequence is decoded once; a request that streams, or that has stop strings, also decodes as
it goes (nanovllm/engine/streaming.py).
"""
import json
from pathlib import Path

from nanovllm.config import Config
from nanovllm.core.sequence import Sequence
from nanovllm.outputs import CompletionOutput, RequestOutput


def eos_token_ids(model: str, hf_config: dict, tokenizer) -> set[int]:
    """End-of-sequence ids: config.json's, generation_config.json's and the tokenizer's."""
    ids = [hf_config.get("eos_token_id"), getattr(tokenizer, "eos_token_id", None)]
    path = Path(model, "generation_config.json")
    if path.is_file():
        ids.append(json.loads(path.read_text()).get("eos_token_id"))
    return {i for x in ids for i in (x if isinstance(x, list) else [x]) if i is not None}


class OutputProcessor:
    def __init__(self, config: Config, tokenizer):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids(config.model, config.hf_config, tokenizer)

    def outputs(self, new_tokens: list[tuple[Sequence, int]]) -> list[RequestOutput]:
        """The outputs of the requests that got new tokens (those that report at each step, or
        ended)."""
        roots = dict.fromkeys(seq.group[0] for seq, _ in new_tokens
                              if seq.is_finished or seq.params.output_kind != "final")
        return [self.output(root) for root in roots
                if root.params.output_kind != "final" or all(s.is_finished for s in root.group)]

    def check_stop(self, seq: Sequence, position: int) -> bool:
        """Whether the token at `position` (the latest known one) ends the sequence."""
        p, token = seq.params, seq.token_ids[position]
        if position + 1 - seq.num_prompt_tokens >= p.min_tokens:
            if token in self.eos_token_ids and not p.ignore_eos:
                seq.finish_reason = "stop"
            elif token in p.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
            elif p.stop and (hit := self.stream(seq).stop_string(seq, position + 1)):
                seq.finish_reason, seq.stop_reason = "stop", hit
        if seq.finish_reason is None and position + 1 >= seq.max_len:
            seq.finish_reason = "length"
        return seq.finish_reason is not None

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of tokens ("" without a tokenizer)."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def stream(self, seq: Sequence):
        """The sequence's text as it goes (created the first time a request needs it)."""
        if seq.stream is None:
            from nanovllm.engine.streaming import Stream
            seq.stream = Stream(self.decode)
        return seq.stream

    def completion(self, seq: Sequence, index: int) -> CompletionOutput:
        """One sample: its text and tokens at its end, or so far if it streams."""
        text, token_ids, before = None, seq.completion_token_ids, 0
        if seq.is_finished:
            text = self.decode(token_ids, seq.params.skip_special_tokens)
            if isinstance(seq.stop_reason, str):
                text = text[:text.find(seq.stop_reason)]
        if seq.params.output_kind != "final":
            text, token_ids, before = self.stream(seq).report(seq, text)
        out = CompletionOutput(index, text, token_ids, finish_reason=seq.finish_reason,
                               stop_reason=seq.stop_reason)
        if seq.params.logprobs is not None:
            out.logprobs, out.cumulative_logprob = seq.logprobs[before:], seq.cumulative_logprob
        return out

    def output(self, root: Sequence) -> RequestOutput:
        """The request's output: each sample (all its sequences, for n > 1), finished or so far."""
        samples = [self.completion(seq, i) for i, seq in enumerate(root.group)]
        finished = all(seq.is_finished for seq in root.group)
        return RequestOutput(root.request_id, root.prompt, root.prompt_token_ids, samples, finished,
                             root.num_cached_tokens, root.metrics)
