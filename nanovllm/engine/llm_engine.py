"""The engine loop: admit requests, then `step()`: schedule, run the model, record the tokens.

`add_request` validates a request and refuses one that could never fit; `step` runs one
iteration of continuous batching and returns the requests that finished in it. `beam_search`
drives the same steps, advancing every prompt's beams whenever they all have their candidates.
With tensor_parallel_size > 1 the engine also starts one worker process per extra rank; `shutdown()`
(or leaving a `with LLM(...)` block, or the engine being collected, or the program's exit) stops them.
"""
import gc
import json
import os
import time
import weakref

from tqdm.auto import tqdm

from nanovllm.config import Config
from nanovllm.engine.beam_search import BeamSearch
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.distributed import Workers
from nanovllm.engine.model_runner import ModelRunner, SampledTokens
from nanovllm.engine.scheduler import ScheduledBatch, Scheduler
from nanovllm.engine.sequence import Sequence, num_blocks_for
from nanovllm.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, model: str, **options):
        self.config = config = Config.from_options(model, **options)
        self.tokenizer = None
        if not config.skip_tokenizer_init:
            from transformers import AutoTokenizer
            self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.eos_token_ids = self._eos_token_ids()
        self.workers, self._stop_workers = None, None
        self.in_flight: tuple[ScheduledBatch, SampledTokens] | None = None  # the launched step not read yet
        if config.tensor_parallel_size > 1:
            self.workers = Workers(config)  # ranks 1..N-1, each in a process of its own
            self._stop_workers = weakref.finalize(self, self.workers.shutdown)  # also when collected or at exit
        try:
            self.model_runner = ModelRunner(config, self.workers.group if self.workers else None)
        except BaseException:
            self.shutdown()
            raise
        self.block_manager = BlockManager(self.model_runner.num_kvcache_blocks, config.kvcache_block_size,
                                          config.enable_prefix_caching, self.model_runner.num_cpu_blocks)
        self.scheduler = Scheduler(config, self.block_manager)

    def shutdown(self):
        """Stop the tensor-parallel workers and free the model, its KV cache and the rendezvous port."""
        if self._stop_workers is not None:
            self._stop_workers()  # runs Workers.shutdown once
        self.model_runner, self.in_flight = None, None
        gc.collect()  # the model's modules hold reference cycles: free their memory (and process groups) now

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def _eos_token_ids(self) -> set[int]:
        ids = [self.config.hf_config.get("eos_token_id")]
        path = os.path.join(self.config.model, "generation_config.json")
        if os.path.isfile(path):
            with open(path) as f:
                ids.append(json.load(f).get("eos_token_id"))
        if self.tokenizer is not None:
            ids.append(self.tokenizer.eos_token_id)
        flat = set()
        for i in ids:
            flat.update(i if isinstance(i, list) else [i])
        return flat - {None}

    def make_sequence(self, prompt: str | list[int], params: SamplingParams | None, beam_width: int = 0) -> Sequence:
        """Validate one request and build its (root) sequence (nothing is queued yet)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop={params.stop} needs the tokenizer; use stop_token_ids or drop skip_tokenizer_init")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs the tokenizer; pass token ids or drop skip_tokenizer_init")
            prompt = self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) for t in prompt):
            raise TypeError("a prompt must be a string or a list of token ids (int)")
        vocab, max_len = self.config.hf_config["vocab_size"], self.config.max_model_len
        if not prompt:
            raise ValueError("prompt is empty: it needs at least one token")
        if len(prompt) > max_len:
            raise ValueError(f"prompt has {len(prompt)} tokens, more than max_model_len={max_len}")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if params.logprobs is not None and params.logprobs > vocab:
            raise ValueError(f"logprobs={params.logprobs} is more than the vocabulary size {vocab}")
        width = max(params.n, beam_width)  # sequences the request may run at once
        if width > self.config.max_num_seqs:
            raise ValueError(f"the request runs {width} sequences at once (n or beam_width) but "
                             f"max_num_seqs={self.config.max_num_seqs}")
        # the worst case: preempted by recomputation, its sequences share nothing but full prompt blocks
        need = width * num_blocks_for(min(len(prompt) + params.max_tokens, max_len), self.config.kvcache_block_size)
        if need > self.block_manager.num_blocks:
            raise ValueError(f"the request needs {need} KV-cache blocks but the whole cache has "
                             f"{self.block_manager.num_blocks}; lower max_tokens (or n) or enlarge the cache")
        return Sequence(prompt, params, self.config.kvcache_block_size)

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams | None = None) -> int:
        """Queue a request; returns its id (a ValueError for a request that can never run)."""
        seq = self.make_sequence(prompt, sampling_params)
        self.scheduler.add(seq)
        return seq.seq_id

    def step(self) -> tuple[list[dict], int]:
        """One iteration: returns the outputs of requests finished now and the number of tokens processed
        (positive for a prefill step, negative for a decode step: the progress bar's two speeds; 0 when idle).

        The engine runs one step ahead: it schedules and launches a step before it reads the tokens of the
        step before (the new step takes them on the device, through placeholders), so the GPU does not wait
        while the host schedules. A sequence that ended at the earlier step wastes one token of the new one.
        Steps whose tokens the host needs at once (beam candidates, log-probabilities) are read at once."""
        if self.model_runner is None:
            raise RuntimeError("the engine was shut down")
        launched, num_tokens = None, 0
        if self.scheduler.has_unfinished():
            batch = self.scheduler.schedule()
            launched = batch, self.model_runner.run(batch)
            self.scheduler.advance(batch)
            num_tokens = sum(batch.num_new_tokens) if batch.is_prefill else -len(batch.seqs)
        previous, self.in_flight = self.in_flight, launched
        outputs = self._read_step(*previous) if previous else []
        if launched and all(seq.is_finished for seq, _, _ in batch.sampled):
            self.in_flight = None  # no token of it is needed (every sequence that samples in it has ended)
        if launched and any(seq.beam_width or seq.params.logprobs is not None for seq in batch.seqs):
            outputs += self._read_step(*launched)
            self.in_flight = None
        return outputs, num_tokens

    def _read_step(self, batch: ScheduledBatch, sampled: SampledTokens) -> list[dict]:
        """Wait for a launched step's tokens, record them, and return the requests that finished."""
        finished = []
        for seq, position in self.scheduler.postprocess(batch, sampled.tolist(), sampled.logprobs):
            if self._check_finished(seq, position):
                del seq.token_ids[position + 1:]  # the placeholder of a step that ran past the end
                finished.append(seq)
        self.scheduler.finish(finished)
        roots = {seq.group[0].seq_id: seq.group[0] for seq in finished}  # a request ends with its last sample
        return [self.output(r) for r in roots.values() if all(s.is_finished for s in r.group)]

    def _check_finished(self, seq: Sequence, position: int) -> bool:
        """Whether the token at `position` (the latest known one) ends the sequence; sets finish_reason."""
        p, token, length = seq.params, seq.token_ids[position], position + 1
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            seq.finish_reason = "stop"
        elif p.stop and self._stop_string_at(seq, length) is not None:
            seq.finish_reason = "stop"
        elif length - seq.num_prompt_tokens >= p.max_tokens or length >= self.config.max_model_len:
            seq.finish_reason = "length"
        return seq.finish_reason is not None

    def _stop_string_at(self, seq: Sequence, length: int | None = None) -> int | None:
        """Where the first stop string starts in the text of the completion's tokens before `length`."""
        text = self.tokenizer.decode(seq.token_ids[seq.num_prompt_tokens:length], skip_special_tokens=True)
        hits = [i for i in (text.find(s) for s in seq.params.stop) if i >= 0]
        return min(hits) if hits else None

    def decode(self, token_ids: list[int]) -> str:
        """The text of generated tokens ("" without a tokenizer)."""
        return "" if self.tokenizer is None else self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def completion(self, seq: Sequence) -> dict:
        """One generated sample: text, token ids, finish reason, and log-probabilities when asked."""
        text = self.decode(seq.completion_token_ids)
        if seq.params.stop and self.tokenizer is not None:
            cut = self._stop_string_at(seq)
            text = text if cut is None else text[:cut]
        out = {"text": text, "token_ids": seq.completion_token_ids, "finish_reason": seq.finish_reason}
        if seq.params.logprobs is not None:
            out["logprobs"], out["cumulative_logprob"] = seq.logprobs, seq.cumulative_logprob
        return out

    def output(self, root: Sequence) -> dict:
        """The result of a finished request: its first sample at the top level, all n under "outputs"."""
        samples = [self.completion(seq) for seq in root.group]
        return {"request_id": root.seq_id, **samples[0], "outputs": samples, "num_cached_tokens": root.num_cached_tokens,
                "prompt_token_ids": root.token_ids[:root.num_prompt_tokens]}

    def is_finished(self) -> bool:
        return not self.scheduler.has_unfinished() and self.in_flight is None

    def generate(self, prompts: list[str] | list[list[int]], sampling_params=None, use_tqdm: bool = True) -> list[dict]:
        """Run prompts to completion; one output dict per prompt, in input order. Requests queued earlier with
        `add_request` are served in the same steps, but their outputs are `step()`'s to return, not this."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params has {len(sampling_params)} entries for {len(prompts)} prompts")
        seqs = [self.make_sequence(p, sp) for p, sp in zip(prompts, sampling_params)]  # all valid before any runs
        for seq in seqs:
            self.scheduler.add(seq)
        order = {seq.seq_id: i for i, seq in enumerate(seqs)}
        outputs = [None] * len(seqs)
        bar = tqdm(total=len(seqs), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        prefill_tps = decode_tps = 0.0
        while any(o is None for o in outputs):
            t = time.perf_counter()
            finished, num_tokens = self.step()
            rate = abs(num_tokens) / (time.perf_counter() - t)
            prefill_tps, decode_tps = (rate, decode_tps) if num_tokens > 0 else (prefill_tps, rate)
            bar.set_postfix(prefill=f"{prefill_tps:.0f}tok/s", decode=f"{decode_tps:.0f}tok/s", refresh=False)
            for out in finished:
                if out["request_id"] in order:
                    outputs[order[out["request_id"]]] = out
                    bar.update(1)
        bar.close()
        return outputs

    def beam_search(self, prompts: list[str] | list[list[int]], beam_width: int, max_tokens: int = 16,
                    length_penalty: float = 1.0) -> list[list[dict]]:
        """Beam search per prompt: the beams best first, each with text, token_ids, cumulative_logprob, score and
        finish_reason (rules: nanovllm.engine.beam_search). Beam width 1 is greedy decoding."""
        if not isinstance(beam_width, int) or beam_width < 1:
            raise ValueError(f"beam_width={beam_width} must be an integer >= 1")
        vocab = self.config.hf_config["vocab_size"]
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=min(2 * beam_width, vocab))
        roots = [self.make_sequence(p, params, beam_width) for p in prompts]  # all valid before any runs
        searches = [BeamSearch(root, beam_width, max(1, min(max_tokens, self.config.max_model_len - root.num_tokens)),
                               length_penalty, self.eos_token_ids) for root in roots]
        for root in roots:
            self.scheduler.add(root)
        while not all(search.done for search in searches):
            self.step()
            for search in searches:
                if not search.done and search.ready():
                    search.advance(self.scheduler)
        return [[{"text": self.decode(h.token_ids), "token_ids": h.token_ids, "cumulative_logprob": h.cumulative_logprob,
                  "score": h.score, "finish_reason": h.finish_reason} for h in search.finished] for search in searches]
