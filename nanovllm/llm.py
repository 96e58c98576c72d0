"""The public entry point: `LLM(model, **options).generate(prompts, sampling_params)`, and `chat`,
`stream` and `beam_search`, each a loop over the engine's `add_request` and `step`."""
import time
from dataclasses import replace

from tqdm.auto import tqdm

from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams


class LLM(LLMEngine):
    def _queue_all(self, prompts, params, output_kind: str | None = None) -> list:
        """Validate every request, then queue them all (as `output_kind` if given); their ids."""
        prompts = prompts if isinstance(prompts, (list, tuple)) else [prompts]  # one prompt
        params = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params has {len(params)} items for {len(prompts)} prompts")
        if output_kind is not None:  # a copy: the caller's object stays as it was
            params = [replace(p or SamplingParams(), output_kind=output_kind)
                      if isinstance(p, SamplingParams | None) else p for p in params]
        seqs = [self.input_processor.make_sequence(p, sp) for p, sp in zip(prompts, params)]
        return [self.queue(seq) for seq in seqs]

    def _run(self, request_ids: list):
        """Step until these requests end, yielding their outputs (other requests' outputs are kept
        for the caller's next step()); requests left when the caller stops early are aborted."""
        pending = set(request_ids)
        try:
            while pending:
                for out in self.step():
                    if out.request_id not in pending:
                        self.held.append(out)
                        continue
                    if out.finished:
                        pending.discard(out.request_id)
                    yield out
                # the ones the caller aborted meanwhile go
                pending &= self.requests.keys() | {out.request_id for out in self.held}
        finally:
            for request_id in pending:
                self.abort_request(request_id)

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Run prompts to completion: one RequestOutput per prompt, in order (`out.outputs[0].text`,
        or nano-vllm's `out["text"]`). Interrupted, it aborts its requests before it raises."""
        request_ids = self._queue_all(prompts, sampling_params, output_kind="final")
        outputs = dict.fromkeys(request_ids)
        num_prompt = num_generated = 0
        start = time.perf_counter()
        with tqdm(total=len(request_ids), desc="Generating", dynamic_ncols=True,
                  disable=not use_tqdm) as bar:
            for out in self._run(request_ids):
                outputs[out.request_id] = out
                num_prompt += len(out.prompt_token_ids)
                num_generated += sum(len(sample.token_ids) for sample in out.outputs)
                seconds = time.perf_counter() - start  # vLLM's rates: tokens over the time so far
                bar.set_postfix_str(f"input: {num_prompt / seconds:.0f} tok/s, "
                                    f"output: {num_generated / seconds:.0f} tok/s", refresh=False)
                bar.update(1)
        return list(outputs.values())

    def stream(self, prompts, sampling_params=None):
        """Generate, yielding RequestOutputs as tokens arrive (each request's text and tokens so
        far; only the new ones with output_kind="delta"); the last one of a request has
        finished=True."""
        yield from self._run(self._queue_all(prompts, sampling_params))

    def chat(self, messages: list, sampling_params=None, use_tqdm: bool = True, **template_options):
        """Replies to one conversation (a list of {"role", "content"} messages) or a list of them,
        formatted by the tokenizer's chat template; one RequestOutput per conversation."""
        if self.tokenizer is None:
            raise ValueError("chat needs the tokenizer (drop skip_tokenizer_init)")
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [self.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True,
                                                      **template_options) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def beam_search(self, prompts, beam_width: int, max_tokens: int = 16,
                    length_penalty: float = 1.0):
        """Beam search per prompt: the beams best first, each with text, token_ids,
        cumulative_logprob, score and finish_reason (the rules: nanovllm/engine/beam_search.py).
        Width 1 is greedy."""
        from nanovllm.engine.beam_search import beam_search
        return beam_search(self, prompts, beam_width, max_tokens, length_penalty)

    def trace(self, path):
        """A context manager that records every step into a JSON trace at `path`
        (nanovllm/trace.py); `python -m nanovllm.viz` draws it."""
        from nanovllm.trace import Trace
        return Trace(self, path)
