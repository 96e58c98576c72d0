"""Beam search on the paged KV cache: the paper's fork, append and free (vLLM, section 4.4).

Every live beam of a prompt is a Sequence in the engine, and the beams of a prompt form one group.
Each engine step gives every live beam its candidates: the log-probabilities (raw log-softmax) of
its 2w most likely next tokens. When all beams of a prompt have theirs, `advance` keeps the best
w candidates: a beam chosen once appends its token; a beam chosen again is first forked (the child
shares all its blocks; whichever writes first into the shared last block copies it); a beam not
chosen is freed. The rules are Hugging Face's (`generate(num_beams=w)`, early_stopping=False):
score = cumulative_logprob / num_generated_tokens ** length_penalty (the EOS token counted); only a
candidate ranked among the top w may finish (by EOS, or by reaching max_tokens); the search stops
when w beams have finished and the best live beam's score at its current length is no better than
the worst of them.
"""
from dataclasses import dataclass

from nanovllm.core.scheduler import Scheduler
from nanovllm.core.sequence import Sequence, SequenceStatus
from nanovllm.core.sharing import fork
from nanovllm.sampling_params import SamplingParams


@dataclass
class Hypothesis:
    """A finished beam."""
    token_ids: list[int]  # generated tokens, the EOS token included
    cumulative_logprob: float
    score: float
    finish_reason: str


class BeamSearch:
    """The beams of one prompt, driven one engine step at a time."""

    def __init__(self, root: Sequence, beam_width: int, max_tokens: int, length_penalty: float,
                 eos_token_ids: set[int]):
        root.beam_width = beam_width
        self.beams, self.finished = [root], []
        self.beam_width, self.max_tokens = beam_width, max_tokens
        self.length_penalty = length_penalty
        self.eos_token_ids = eos_token_ids

    @property
    def done(self) -> bool:
        return not self.beams

    def ready(self) -> bool:
        """Whether every live beam holds its KV and the candidates for its next token."""
        return all(b.status == SequenceStatus.RUNNING and b.candidates is not None
                   for b in self.beams)

    def score(self, cumulative_logprob: float, length: int) -> float:
        return cumulative_logprob / length ** self.length_penalty

    def advance(self, scheduler: Scheduler):
        """One beam step: keep the best candidates, then fork, append and free."""
        w, length = self.beam_width, len(self.beams[0].completion_token_ids) + 1
        candidates = sorted(((beam.cumulative_logprob + logprob, beam, token) for beam in self.beams
                             for token, logprob in beam.candidates.items()), key=lambda c: -c[0])
        chosen: dict[Sequence, list[int]] = {beam: [] for beam in self.beams}
        num_live = 0
        for rank, (cum, beam, token) in enumerate(candidates):
            ends = token in self.eos_token_ids or length == self.max_tokens
            if ends and rank < w:
                reason = "stop" if token in self.eos_token_ids else "length"
                tokens = beam.completion_token_ids + [token]
                self.finished.append(Hypothesis(tokens, cum, self.score(cum, length), reason))
            elif not ends and num_live < w:
                chosen[beam].append(token)
                num_live += 1
        self.finished = sorted(self.finished, key=lambda h: -h.score)[:w]
        self.beams = []
        for beam, tokens in chosen.items():
            candidates, beam.candidates = beam.candidates, None
            # before the beam appends
            forks = [fork(beam, scheduler.block_manager) for _ in tokens[1:]]
            scheduler.running.extend(forks)
            for seq, token in zip([beam] + forks, tokens):
                seq.token_ids.append(token)
                seq.set_token(len(seq) - 1, token, candidates)
                self.beams.append(seq)
        scheduler.finish([beam for beam, tokens in chosen.items() if not tokens])
        if len(self.finished) == w and self.beams and self._cannot_improve(length):
            scheduler.finish(self.beams)
            self.beams = []

    def _cannot_improve(self, length: int) -> bool:
        best = max(b.cumulative_logprob for b in self.beams)
        return self.score(best, length) <= self.finished[-1].score


def beam_search(engine, prompts: list, beam_width: int, max_tokens: int,
                length_penalty: float) -> list[list[dict]]:
    """Drive the engine's steps until every prompt's search is done; the finished beams, best
    first."""
    if not isinstance(beam_width, int) or beam_width < 1:
        raise ValueError(f"beam_width={beam_width} must be an integer >= 1")
    vocab = engine.config.hf_config["vocab_size"]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            logprobs=min(2 * beam_width, vocab))
    # all prompts checked before any is queued
    roots = [engine.input_processor.make_sequence(p, params, beam_width) for p in prompts]
    eos = engine.output_processor.eos_token_ids
    searches = [BeamSearch(root, beam_width, max(1, min(max_tokens, root.max_len - len(root))),
                           length_penalty, eos) for root in roots]
    for root in roots:
        engine.scheduler.waiting.append(root)
    try:
        while not all(search.done for search in searches):
            # held outputs come back too: `held += step()` would double them
            outputs = engine.step()
            engine.held.extend(outputs)  # other requests' outputs, for the caller's next step()
            for search in searches:
                if not search.done and search.ready():
                    search.advance(engine.scheduler)
    finally:  # interrupted: the live beams go
        engine.scheduler.finish([beam for search in searches for beam in search.beams
                                 if not beam.is_finished])
    decode = engine.output_processor.decode
    return [[{"text": decode(h.token_ids), "token_ids": h.token_ids,
              "cumulative_logprob": h.cumulative_logprob, "score": h.score,
              "finish_reason": h.finish_reason} for h in search.finished]
            for search in searches]
