"""OpenAI's response bodies, built from the engine's RequestOutputs: completions and chat
completions, whole or as server-sent-event chunks, with usage and log-probabilities.

A choice's index numbers the samples of every prompt in order: prompt i's sample j is i * n + j.
"""
import json
import time
from dataclasses import dataclass, field


@dataclass
class Choices:
    """What one HTTP request has reported so far, per choice and in all."""
    kind: str                   # "completion" or "chat"
    request_id: str
    model: str
    n: int
    num_logprobs: int | None
    decode: object              # token id -> its text (the tokenizer's)
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_tokens: int = 0
    completion_tokens: int = 0
    started: set = field(default_factory=set)       # chat choices that sent their role
    finished: set = field(default_factory=set)      # choices that sent their finish_reason
    text_offsets: dict = field(default_factory=dict)  # completion choice -> its text length so far
    prompts_seen: set = field(default_factory=set)  # prompts whose tokens usage counts

    def header(self, obj: str) -> dict:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def count(self, out):
        """Count an output's tokens (a delta, or the whole of a final output)."""
        self.completion_tokens += sum(len(c.token_ids) for c in out.outputs)

    def logprobs(self, index: int, sample) -> dict | None:
        """The choice's log-probabilities in the endpoint's shape (None if not asked for)."""
        if self.num_logprobs is None or sample.logprobs is None:
            return None
        if self.kind == "chat":
            return {"content": [self.chat_logprob(t, lp) for t, lp in zip(sample.token_ids,
                                                                           sample.logprobs)]}
        tokens = [self.decode(t) for t in sample.token_ids]
        offsets, offset = [], self.text_offsets.get(index, 0)
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        self.text_offsets[index] = offset
        return {"tokens": tokens, "token_logprobs": [lp[t] for t, lp in zip(sample.token_ids,
                                                                             sample.logprobs)],
                "top_logprobs": [{self.decode(k): v for k, v in top(lp, self.num_logprobs)}
                                 for lp in sample.logprobs],
                "text_offset": offsets}

    def chat_logprob(self, token_id: int, logprobs: dict[int, float]) -> dict:
        def entry(t, v):
            text = self.decode(t)
            return {"token": text, "logprob": v, "bytes": list(text.encode())}
        return {**entry(token_id, logprobs[token_id]),
                "top_logprobs": [entry(k, v) for k, v in top(logprobs, self.num_logprobs)]}

    def whole(self, outputs: list) -> dict:
        """The non-streamed body: every choice of every prompt (outputs in prompt order)."""
        choices = []
        for i, out in enumerate(outputs):
            self.prompt_tokens += len(out.prompt_token_ids)
            self.count(out)
            for sample in out.outputs:
                index = i * self.n + sample.index
                choice = {"index": index, "logprobs": self.logprobs(index, sample),
                          "finish_reason": sample.finish_reason}
                if self.kind == "chat":
                    choice["message"] = {"role": "assistant", "content": sample.text}
                else:
                    choice["text"] = sample.text
                choices.append(choice)
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {**self.header(obj), "choices": choices, "usage": self.usage()}

    def chunks(self, prompt_index: int, out, include_usage: bool) -> list[str]:
        """Server-sent events for a delta output: one chunk per choice with something new."""
        self.count(out)
        if prompt_index not in self.prompts_seen:
            self.prompts_seen.add(prompt_index)
            self.prompt_tokens += len(out.prompt_token_ids)
        events = []
        for sample in out.outputs:
            index = prompt_index * self.n + sample.index
            ends = sample.finish_reason is not None and index not in self.finished
            if not (sample.text or sample.token_ids or ends or
                    (self.kind == "chat" and index not in self.started)):
                continue
            if ends:
                self.finished.add(index)
            choice = {"index": index, "logprobs": self.logprobs(index, sample),
                      "finish_reason": sample.finish_reason if ends else None}
            if self.kind == "chat":
                choice["delta"] = {"content": sample.text}
                if index not in self.started:
                    self.started.add(index)
                    choice["delta"]["role"] = "assistant"
            else:
                choice["text"] = sample.text
            events.append(self.event([choice], include_usage))
        return events

    def event(self, choices: list, include_usage: bool, usage: dict | None = None) -> str:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        body = {**self.header(obj), "choices": choices}
        if include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    def usage_event(self) -> str:
        return self.event([], True, self.usage())


def top(logprobs: dict[int, float], m: int) -> list[tuple[int, float]]:
    """The m most likely tokens of a step (the engine also holds the chosen one, if less likely)."""
    return sorted(logprobs.items(), key=lambda kv: -kv[1])[:m]


DONE = "data: [DONE]\n\n"
