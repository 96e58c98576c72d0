"""Never crash on valid input, never lose a request, and say what is wrong.

Requests end at max_model_len; vLLM's abort_request frees a waiting, running or swapped-out request
at once, and generate, beam_search and stream abort their own requests when interrupted; nothing a
caller queued is lost; seeds are integers that reproduce across processes; bad input, checkpoints
and configs get errors naming the argument (or file and tensor) and what is allowed. Each defect
test says in its docstring how the code before the fix failed.
"""
import json
import os
import random
import shutil
import subprocess
import sys
from dataclasses import replace
from itertools import count

import pytest
from safetensors.torch import load_file, save_file

from nanovllm import LLM, SamplingParams
from tests.helpers import drain, make_llm, random_prompts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def copy_checkpoint(src: str, dst, **config_changes) -> str:
    """A copy of the checkpoint in src, its config.json updated (None deletes a key)."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        config = json.load(f)
    for key, value in config_changes.items():
        config.pop(key) if value is None else config.__setitem__(key, value)
    with open(path, "w") as f:
        json.dump(config, f)
    return str(dst)


def assert_empty(llm):
    """Nothing queued, nothing held: every KV block (and CPU block) is free."""
    assert not llm.requests and not llm.scheduler.has_unfinished()
    assert llm.block_manager.num_free_blocks == len(llm.block_manager.blocks)
    swap = llm.scheduler.swap
    if swap is not None:
        assert not any(swap.cpu_ref_counts)
        assert len(swap.free_cpu_blocks) == len(swap.cpu_ref_counts)


def run_python(code: str, *args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], check=False, cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def tiny(tiny_path):
    return make_llm(tiny_path)


# 1. max_model_len ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def short_path(tiny_path, tmp_path_factory) -> str:
    """The random Qwen3 with rotary tables of 64 positions: max_model_len defaults to 64."""
    path = tmp_path_factory.mktemp("short") / "model"
    return copy_checkpoint(tiny_path, path, max_position_embeddings=64)


def test_prompt_of_max_model_len_is_refused(short_path, tiny):
    """Before: a 64-token prompt passed the check, then the run-ahead decode step read rotary
    position 64 (IndexError: index 64 is out of bounds), and every later step() raised again."""
    llm = make_llm(short_path)
    assert llm.config.max_model_len == 64
    prompt, short = random_prompts(2, (64, 64), seed=60)
    with pytest.raises(ValueError, match="prompt has 64 tokens; max_model_len=64"):
        llm.generate([prompt], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len=64"):
        llm.add_request(prompt, GREEDY)
    assert llm.is_finished() and llm.step() == []
    out, = llm.generate([short[:10]], GREEDY, use_tqdm=False)  # serves as the long-table model
    ref, = tiny.generate([short[:10]], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids


@pytest.mark.parametrize("max_model_len", [64, 40])
def test_requests_end_exactly_at_max_model_len(short_path, tiny, max_model_len):
    """Before: with max_model_len = max_position_embeddings = 64 the run-ahead step indexed rotary
    position 64 (IndexError); with max_model_len=40 a sequence came back 41 tokens long."""
    llm = make_llm(short_path, max_model_len=max_model_len)
    lengths = (max_model_len - 1, max_model_len - 2, max_model_len - 7)
    prompts = [random_prompts(1, (n, n), seed=61 + n)[0] for n in lengths]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    unlimited = tiny.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out, ref in zip(prompts, outputs, unlimited):
        tokens = out.outputs[0].token_ids
        assert out.outputs[0].finish_reason == "length"
        assert len(prompt) + len(tokens) == max_model_len
        assert tokens == ref.outputs[0].token_ids[:len(tokens)]
    # driven by add_request/step, with nothing else queued
    request_id = llm.add_request(prompts[0], GREEDY)
    outputs = drain(llm)
    assert [o.request_id for o in outputs] == [request_id] and outputs[0].finished
    last = outputs[0].outputs[0]
    assert len(last.token_ids) == 1 and last.finish_reason == "length"
    assert llm.step() == [] and llm.step() == []
    assert_empty(llm)


def test_a_step_that_swaps_out_all_it_had_still_moves_the_blocks(short_path, tiny):
    """A 63-token prompt takes the last four free blocks of eight while two samples of a 62-token
    prompt need a copy-on-write block: the step swaps out their group and has nothing else to run.
    Its swap-out must still run. Before: a step without sequences was never launched, so the
    group's blocks reached the CPU pool unwritten, and the second sample's next token came from
    a zeroed cache (tokens [471, 462] instead of [471, 162])."""
    llm = make_llm(short_path, num_kvcache_blocks=8, preemption_mode="swap", swap_space=0.001)
    moves_only, schedule = [], llm.scheduler.schedule

    def recording():
        batch = schedule()
        moves_only.append(not batch.seqs and bool(batch.swap_out))
        return batch
    llm.scheduler.schedule = recording
    prompts = [random_prompts(1, (n, n), seed=n)[0] for n in (63, 62)]
    params = [GREEDY, SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=8)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert any(moves_only) and llm.get_stats()["num_swapped_out"] == 1
    for out, ref in zip(outputs, tiny.generate(prompts, params, use_tqdm=False)):
        for sample, expected in zip(out.outputs, ref.outputs):
            assert sample.token_ids == expected.token_ids[:len(sample.token_ids)]
    assert_empty(llm)


def test_samples_and_beams_end_at_max_model_len(short_path):
    """Parallel samples and beams of a prompt one token short of max_model_len = 64: one token
    each, finish_reason "length" (before: the run-ahead step read rotary position 64)."""
    llm = make_llm(short_path)
    prompt = random_prompts(1, (63, 63), seed=64)[0]
    out, = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=8),
                        use_tqdm=False)
    assert [len(s.token_ids) for s in out.outputs] == [1, 1, 1]
    assert {s.finish_reason for s in out.outputs} == {"length"}
    beams, = llm.beam_search([prompt], beam_width=2, max_tokens=8)
    assert [len(b["token_ids"]) for b in beams] == [1, 1]
    assert_empty(llm)


# 2. abort_request ------------------------------------------------------------------------------

def test_abort_waiting_and_running_requests_frees_their_blocks(tiny_path, tiny):
    """Before: there was no abort_request (AttributeError): no request could be cancelled."""
    llm = make_llm(tiny_path, num_kvcache_blocks=32)
    prompts = random_prompts(4, (20, 40), seed=70)
    expected = tiny.generate(prompts[3:], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    a, b, c = (llm.add_request(p, GREEDY) for p in prompts[:3])
    assert llm.abort_request(a)  # waiting
    assert a not in llm.requests and len(llm.scheduler.waiting) == 2
    for _ in range(3):
        llm.step()
    assert len(llm.scheduler.running) == 2 and llm.in_flight
    assert llm.block_manager.num_free_blocks < len(llm.block_manager.blocks)
    assert llm.abort_request(b) and llm.abort_request(c)  # running, a step of theirs in flight
    assert llm.block_manager.num_free_blocks == len(llm.block_manager.blocks)  # at once
    assert not llm.abort_request(b) and not llm.abort_request("no-such-request")
    assert drain(llm) == []  # the step in flight reports nothing for aborted requests
    assert_empty(llm)
    assert llm.generate(prompts[3:], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected


def test_an_aborted_request_reports_nothing_more(tiny):
    """Outputs of a request that another generate kept for the caller's next step() go when it is
    aborted. Before: step() still returned them, unfinished, after the abort."""
    early, late = random_prompts(2, (10, 30), seed=79)
    request_id = tiny.add_request(early, GREEDY)
    tiny.step()
    tiny.generate([late], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                  use_tqdm=False)
    assert any(out.request_id == request_id for out in tiny.held)  # kept for the caller
    assert tiny.abort_request(request_id)
    assert drain(tiny) == []
    assert_empty(tiny)


def test_abort_a_request_in_chunked_prefill_or_sharing_blocks(tiny_path, tiny):
    """A request aborted between two chunks of its prefill frees its blocks; one aborted while it
    shares prefix blocks with another leaves the other's blocks (and tokens) alone."""
    llm = make_llm(tiny_path, max_num_batched_tokens=32)
    long = random_prompts(1, (90, 90), seed=77)[0]
    request_id = llm.add_request(long, GREEDY)
    llm.step()
    seq = llm.requests[request_id]
    assert 0 < seq.num_computed_tokens < len(long) and seq.block_table  # one chunk in
    assert llm.abort_request(request_id)
    assert_empty(llm)
    drain(llm)
    prefix = random_prompts(1, (48, 48), seed=78)[0]  # three full blocks, shared
    first, second = prefix + [1, 2, 3], prefix + [4, 5]
    expected = tiny.generate([second], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    ids = []
    for prompt in (first, second):  # the second comes once the first's prompt is in the cache
        ids.append(llm.add_request(prompt, GREEDY))
        for _ in range(3):
            llm.step()
    shared = set(llm.requests[ids[0]].block_table[:3])
    assert shared == set(llm.requests[ids[1]].block_table[:3])
    assert llm.abort_request(ids[0])
    assert all(llm.block_manager.blocks[b].ref_count == 1 for b in shared)
    outputs = drain(llm)
    assert {o.request_id for o in outputs} == {ids[1]}
    assert outputs[-1].outputs[0].token_ids == expected
    assert_empty(llm)


def test_abort_a_swapped_out_request(tiny_path):
    """Before: no abort_request; a swapped-out request could only run to its end."""
    llm = make_llm(tiny_path, num_kvcache_blocks=8, preemption_mode="swap", swap_space=0.001)
    swap = llm.scheduler.swap
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ids = [llm.add_request(p, params) for p in random_prompts(6, (10, 50), seed=40)]
    for _ in range(200):
        if swap.swapped:
            break
        llm.step()
    assert swap.swapped, "the tiny cache never swapped a request out"
    victim = swap.swapped[0][0].request_id
    assert llm.abort_request(victim)
    left = {b for group in swap.swapped for seq in group for b in seq.block_table}
    assert victim not in {seq.request_id for group in swap.swapped for seq in group}
    assert len(swap.free_cpu_blocks) == len(swap.cpu_ref_counts) - len(left)  # its CPU blocks
    for request_id in ids:  # the others, wherever they are
        assert llm.abort_request(request_id) == (request_id != victim)
    assert_empty(llm)
    assert drain(llm) == []
    assert_empty(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_random_aborts_under_preemption(tiny_path, tiny, mode):
    """Seeded requests of 1 to 3 samples in a cache that forces preemption, a random one aborted
    now and then: no output of an aborted request after its abort, the others end with the
    tokens of an unconstrained run, and every block (and CPU block) is free at the end."""
    for trial in range(2):
        llm = make_llm(tiny_path, num_kvcache_blocks=14, preemption_mode=mode, swap_space=0.001)
        rng = random.Random(trial)
        prompts = random_prompts(10, (5, 40), seed=100 + trial)
        params = [SamplingParams(n=rng.choice([1, 2, 3]), temperature=1.0, seed=i, ignore_eos=True,
                                 max_tokens=rng.randint(5, 30)) for i in range(10)]
        expected = tiny.generate(prompts, params, use_tqdm=False)
        ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
        aborted, finals = set(), {}
        while not llm.is_finished():
            for out in llm.step():
                assert out.request_id not in aborted
                if out.finished:
                    finals[out.request_id] = out
            live = [request_id for request_id in ids if request_id in llm.requests]
            if live and rng.random() < 0.1:
                victim = rng.choice(live)
                assert llm.abort_request(victim)
                aborted.add(victim)
        assert llm.scheduler.num_preemptions > 0 and aborted
        assert_empty(llm)
        for request_id, ref in zip(ids, expected):
            if request_id not in aborted:
                assert [s.token_ids for s in finals[request_id].outputs] == \
                    [s.token_ids for s in ref.outputs]


def interrupt_at(call: int, function):
    """`function`, raising KeyboardInterrupt at its call number `call` (Ctrl-C landing there)."""
    calls = count(1)

    def wrapper(*args):
        if next(calls) == call:
            raise KeyboardInterrupt
        return function(*args)
    return wrapper


def queue_earlier_requests(llm, tiny, seed: int) -> tuple[list, list]:
    """Three requests (n = 1, 2, 3 seeded samples) queued with add_request and stepped three
    times, as another caller would: their ids, and each sample's tokens in an unconstrained run on
    `tiny`."""
    early = random_prompts(3, (10, 30), seed=seed)
    params = [SamplingParams(n=n, temperature=1.0, seed=n, max_tokens=25, ignore_eos=True)
              for n in (1, 2, 3)]
    expected = [[s.token_ids for s in out.outputs]
                for out in tiny.generate(early, params, use_tqdm=False)]
    ids = [llm.add_request(p, sp) for p, sp in zip(early, params)]
    for _ in range(3):
        outputs = llm.step()  # `held += step()` would add the held outputs step() returns twice
        llm.held.extend(outputs)
    return ids, expected


def count_steps(llm, monkeypatch, raise_at: int | None = None):
    """Wrap llm.step: counts its calls, and raises KeyboardInterrupt at call `raise_at`."""
    step, calls = llm.step, count(1)
    counter = {"steps": 0}

    def counted():
        counter["steps"] = next(calls)
        if counter["steps"] == raise_at:
            raise KeyboardInterrupt
        return step()
    monkeypatch.setattr(llm, "step", counted)
    return counter


@pytest.mark.parametrize("driver", ["generate", "beam_search"])
def test_interrupted_generate_aborts_its_requests(tiny_path, monkeypatch, driver):
    """Before: after Ctrl-C inside generate its requests stayed queued and held blocks; the next
    generate of one short prompt first ran all of them (49 to 72 s when it was measured)."""
    llm = make_llm(tiny_path)
    short = random_prompts(1, (5, 5), seed=71)[0]
    expected = llm.generate([short], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    prompts = random_prompts(8, (20, 60), seed=72)
    count_steps(llm, monkeypatch, raise_at=4)
    with pytest.raises(KeyboardInterrupt):
        if driver == "generate":
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                         use_tqdm=False)
        else:
            llm.beam_search(prompts, beam_width=3, max_tokens=200)
    assert_empty(llm)
    counter = count_steps(llm, monkeypatch)
    out, = llm.generate([short], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == expected
    assert counter["steps"] <= GREEDY.max_tokens + 2  # prefill, decodes, one to read the last
    drain(llm)
    assert_empty(llm)


def test_interrupt_while_reading_a_step_aborts_generates_requests(tiny_path, monkeypatch):
    """Ctrl-C on a GPU most often lands where the host waits for a step's tokens
    (SampledTokens.tolist): generate's own requests are aborted, the step launched after the
    one it waited for is dropped too, and the next generate still serves correctly."""
    from nanovllm.worker.run_ahead import SampledTokens
    llm = make_llm(tiny_path)
    short = random_prompts(1, (5, 5), seed=90)[0]
    expected = llm.generate([short], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    monkeypatch.setattr(SampledTokens, "tolist", interrupt_at(4, SampledTokens.tolist))
    with pytest.raises(KeyboardInterrupt):
        llm.generate(random_prompts(4, (10, 40), seed=91), GREEDY, use_tqdm=False)
    assert_empty(llm)
    assert not llm.in_flight  # the step launched before the interrupt used the lost tokens
    assert llm.generate([short], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected
    assert_empty(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_interrupt_while_reading_leaves_other_requests_intact(tiny_path, tiny, monkeypatch, mode):
    """Ctrl-C while the host waits for a step's tokens, with requests queued earlier by another
    caller: the tokens of that step are lost, and the step launched after it used them on the
    device. Both steps' sequences start over, and the earlier requests end with the tokens of an
    unconstrained run. Before: they kept the lost step's placeholders."""
    from nanovllm.worker.run_ahead import SampledTokens
    llm = make_llm(tiny_path, num_kvcache_blocks=14, preemption_mode=mode, swap_space=0.001,
                   max_num_batched_tokens=32)
    ids, expected = queue_earlier_requests(llm, tiny, seed=92)
    monkeypatch.setattr(SampledTokens, "tolist", interrupt_at(3, SampledTokens.tolist))
    with pytest.raises(KeyboardInterrupt):
        llm.generate(random_prompts(3, (10, 40), seed=93), GREEDY, use_tqdm=False)
    monkeypatch.undo()
    finals = {o.request_id: o for o in drain(llm) if o.finished}
    assert [[s.token_ids for s in finals[i].outputs] for i in ids] == expected
    assert_empty(llm)


def test_interrupt_from_a_progress_bar_callback(tiny_path, monkeypatch):
    """Before: an exception raised inside generate's loop (here by its progress bar) left every
    request queued and its blocks held."""
    import nanovllm.llm

    class Bar:  # tqdm's interface as generate uses it; the second finished request raises
        def __init__(self, **kwargs):
            self.n = 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def set_postfix_str(self, *args, **kwargs):
            pass

        def update(self, n):
            self.n += n
            if self.n == 2:
                raise RuntimeError("stop")
    monkeypatch.setattr(nanovllm.llm, "tqdm", Bar)
    llm = make_llm(tiny_path)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (2, 3, 99, 99)]
    with pytest.raises(RuntimeError, match="stop"):
        llm.generate(random_prompts(4, (10, 30), seed=73), params)
    assert_empty(llm)


def test_stream_stopped_early_aborts_its_requests(tiny):
    """Before: llm.stream did not exist; a loop over step() that stopped left its requests
    queued."""
    for out in tiny.stream(random_prompts(3, (10, 30), seed=74), GREEDY):
        assert not out.finished
        break
    assert_empty(tiny)
    drain(tiny)
    assert_empty(tiny)


def test_aborting_a_streamed_request_ends_its_part_of_the_stream(tiny, monkeypatch):
    """The caller aborts one of two streamed requests at its first output: the stream goes on
    with the other and ends. Before: llm.stream stepped an idle engine forever, waiting for the
    aborted request's last output."""
    prompts = random_prompts(2, (10, 30), seed=86)
    expected = [o.outputs[0].token_ids for o in tiny.generate(prompts, GREEDY, use_tqdm=False)]
    step, calls = tiny.step, count(1)

    def bounded():
        assert next(calls) < 100, "the stream did not end"
        return step()
    monkeypatch.setattr(tiny, "step", bounded)
    outputs = []
    for out in tiny.stream(prompts, GREEDY):
        if not outputs:
            assert tiny.abort_request(out.request_id)
        outputs.append(out)
    aborted, *others = [o.request_id for o in outputs]
    assert len(set(others)) == 1 and aborted not in others and len(others) == GREEDY.max_tokens
    assert outputs[-1].finished
    assert outputs[-1].outputs[0].token_ids == expected[int(others[0] > aborted)]
    assert_empty(tiny)


def test_a_stream_paused_while_a_generate_runs_gets_all_its_outputs(tiny):
    """A generate runs while a stream waits at its first output: the streamed requests end during
    the generate, and the stream, resumed, still yields their outputs up to the last."""
    prompts = random_prompts(3, (10, 30), seed=87)
    expected = [o.outputs[0].token_ids for o in tiny.generate(prompts[:2], GREEDY, use_tqdm=False)]
    stream = tiny.stream(prompts[:2], GREEDY)
    outputs = [next(stream)]
    longer = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    tiny.generate(prompts[2:], longer, use_tqdm=False)
    outputs += stream
    finals = sorted((o for o in outputs if o.finished), key=lambda o: o.request_id)
    assert len(finals) == 2 and [o.outputs[0].token_ids for o in finals] == expected
    assert len(outputs) == 2 * GREEDY.max_tokens
    assert_empty(tiny)


# 3. requests queued before a generate ----------------------------------------------------------

@pytest.mark.parametrize("driver", ["generate", "beam_search", "stream"])
def test_requests_queued_before_generate_keep_their_outputs(tiny, driver):
    """Before: generate and beam_search drove step() and threw away the outputs of requests queued
    earlier with add_request: such a request never got its output."""
    early, late = random_prompts(2, (10, 30), seed=75)
    expected = tiny.generate([early], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    request_id = tiny.add_request(early, GREEDY)
    tiny.step()
    longer = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    if driver == "generate":  # runs longer than the early request: that one ends meanwhile
        tiny.generate([late], longer, use_tqdm=False)
    elif driver == "stream":
        assert {out.request_id for out in tiny.stream([late], longer)} == {request_id + 1}
    else:
        tiny.beam_search([late], beam_width=2, max_tokens=40)
    outputs = drain(tiny)
    assert {o.request_id for o in outputs} == {request_id}
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert outputs[-1].outputs[0].token_ids == expected
    assert_empty(tiny)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("site", ["execute", "forward", "sample"])
def test_an_interrupt_inside_a_step_leaves_other_requests_intact(tiny_path, tiny, monkeypatch,
                                                                 site, mode):
    """Ctrl-C lands inside the model runner (before the block moves, in the forward, or in the
    sampler) while a generate runs beside requests queued earlier with add_request, in a cache
    that preempts. The step never launched: its sequences start over, and the earlier requests
    end with the tokens of an unconstrained run. Before: they kept the placeholders of the step
    that never ran: a token -1 in the output and wrong tokens after it, or an IndexError in a
    later step (index 3 is out of bounds for dimension 0 with size 2)."""
    import nanovllm.layers.sampler as sampler
    llm = make_llm(tiny_path, num_kvcache_blocks=14, preemption_mode=mode, swap_space=0.001,
                   max_num_batched_tokens=32)
    ids, expected = queue_earlier_requests(llm, tiny, seed=88)
    runner = llm.model_runner
    params = GREEDY
    if site == "sample":  # greedy rows take the argmax: these requests sample, seeded
        params = replace(GREEDY, temperature=1.0, seed=5)
        monkeypatch.setattr(sampler, "sample", interrupt_at(3, sampler.sample))
    else:
        owner = runner if site == "execute" else runner.model
        monkeypatch.setattr(owner, site, interrupt_at(3, getattr(owner, site)))
    with pytest.raises(KeyboardInterrupt):
        llm.generate(random_prompts(3, (10, 40), seed=89), params, use_tqdm=False)
    monkeypatch.undo()
    finals = {o.request_id: o for o in drain(llm) if o.finished}
    assert [[s.token_ids for s in finals[i].outputs] for i in ids] == expected
    assert_empty(llm)


def test_interrupted_generate_keeps_requests_queued_before_it(tiny, monkeypatch):
    """An interrupted generate aborts its own requests only: one queued before it with
    add_request still runs to its end, with the tokens it gets alone."""
    early, *prompts = random_prompts(4, (10, 30), seed=76)
    expected = tiny.generate([early], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    request_id = tiny.add_request(early, GREEDY)
    count_steps(tiny, monkeypatch, raise_at=3)
    with pytest.raises(KeyboardInterrupt):
        tiny.generate(prompts, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert list(tiny.requests) == [request_id]
    outputs = drain(tiny)
    assert {o.request_id for o in outputs} == {request_id}
    assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == expected
    assert_empty(tiny)


# 4. seeds --------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", ["1234", 1.5, b"7", True])
def test_seed_must_be_an_integer(seed):
    """Before: a string seed went through hash(), different in every process; 1.5 was accepted."""
    with pytest.raises(TypeError, match=r"^seed=.* must be None or an integer in"):
        SamplingParams(seed=seed)


SEEDED_RUN = """
import sys
import torch
torch.set_num_threads(1)
from nanovllm import SamplingParams
from tests.helpers import make_llm
llm = make_llm(sys.argv[1])
params = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
print("TOKENS", llm.generate([[5, 17, 33, 2, 99]], params, use_tqdm=False)[0].outputs[0].token_ids)
"""


@pytest.mark.slow
def test_same_seed_same_tokens_in_separate_processes(tiny_path, tiny):
    """The same integer seed draws the same tokens in two processes (hash randomization differing)
    and in this one."""
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    here = tiny.generate([[5, 17, 33, 2, 99]], params, use_tqdm=False)
    runs = []
    for hash_seed in ("1", "2"):
        result = run_python(SEEDED_RUN, tiny_path, env={**os.environ, "PYTHONHASHSEED": hash_seed})
        assert result.returncode == 0, result.stderr[-2000:]
        runs.append(result.stdout.split("TOKENS", 1)[1].strip())
    assert runs[0] == runs[1] == str(here[0].outputs[0].token_ids)


# 5. errors that say what is wrong --------------------------------------------------------------

def test_model_without_tokenizer_fails_at_construction(tiny_path):
    """Before: a directory without tokenizer files silently got an empty tokenizer: token 0 became
    end-of-sequence and every text prompt failed as "prompt is empty"."""
    with pytest.raises(ValueError) as err:
        LLM(tiny_path, num_kvcache_blocks=8)
    assert tiny_path in str(err.value) and "skip_tokenizer_init" in str(err.value)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"temperature": "0.5"}, TypeError, "temperature='0.5' must be a number in [0, 3.4e38]"),
    ({"temperature": float("inf")}, ValueError, "temperature=inf must be a number in [0, 3.4e38]"),
    ({"stop_token_ids": 5}, TypeError, "stop_token_ids=5 must be a list of token ids"),
    ({"seed": 1.5}, TypeError, "seed=1.5 must be None or an integer in [-2**63, 2**64)"),
])
def test_bad_sampling_params_name_the_argument(kwargs, error, message):
    """Before: '>=' not supported between 'str' and 'int'; 'int' object is not iterable; inf and
    1.5 accepted."""
    with pytest.raises(error) as err:
        SamplingParams(**kwargs)
    assert str(err.value).startswith(message)


DICT_OF_PROMPTS = ("a prompt must be a string, a list of token ids (int) or a dict with "
                   "'prompt' or 'prompt_token_ids', not dict")


@pytest.mark.parametrize("prompts, message", [
    (5, "a prompt must be a string, a list of token ids (int) or a dict with"),
    ([[True, False]], "a prompt must be a string, a list of token ids (int)"),
    ({"first": [1, 2], "second": [3, 4]}, DICT_OF_PROMPTS),
])
def test_bad_prompts_name_the_argument(tiny, prompts, message):
    """Before: generate(5) -> "object of type 'int' has no len()"; [True, False] ran as token ids
    1 and 0; a dict of prompts was iterated by its keys."""
    with pytest.raises(TypeError) as err:
        tiny.generate(prompts, GREEDY, use_tqdm=False)
    assert str(err.value).startswith(message)
    assert_empty(tiny)


def break_weights(path: str, how: str):
    """Corrupt the one safetensors file of the checkpoint in `path`; the name of the tensor hit."""
    file = os.path.join(path, "model.safetensors")
    if how == "truncated":
        size = os.path.getsize(file)
        with open(file, "r+b") as f:
            f.truncate(size // 2)
        return None
    tensors = load_file(file)
    name = "model.layers.1.mlp.down_proj.weight"
    if how == "wrong shape":
        tensors[name] = tensors[name].t().contiguous()
    else:  # NaN or inf
        tensors[name][3, 5] = float(how)
    save_file(tensors, file, metadata={"format": "pt"})
    return name


@pytest.mark.parametrize("how, message", [
    ("truncated", "does not read as safetensors"),
    ("wrong shape", ("of shape [128, 64] does not fit model.layers.1.mlp.down_proj.weight of "
                     "shape [64, 128]")),
    ("nan", "holds NaN or inf"),
    ("-inf", "holds NaN or inf"),
])
def test_broken_checkpoint_names_file_and_tensor(tiny_path, tmp_path, how, message):
    """Before: errors from safetensors or torch.copy_ that named neither the file nor the tensor,
    and NaN weights loaded silently."""
    path = copy_checkpoint(tiny_path, tmp_path / "model")
    tensor = break_weights(path, how)
    with pytest.raises(ValueError) as err:
        make_llm(path, num_kvcache_blocks=8)
    assert os.path.join(path, "model.safetensors") in str(err.value) and message in str(err.value)
    assert tensor is None or repr(tensor) in str(err.value)


def test_config_without_vocab_size(tiny_path, tmp_path):
    """Before: a KeyError('vocab_size') naming no file."""
    path = copy_checkpoint(tiny_path, tmp_path / "model", vocab_size=None)
    with pytest.raises(ValueError) as err:
        make_llm(path, num_kvcache_blocks=8)
    assert os.path.join(path, "config.json") in str(err.value) and "vocab_size" in str(err.value)


def test_config_with_broken_json(tiny_path, tmp_path):
    """Before: json's JSONDecodeError, naming no file."""
    path = copy_checkpoint(tiny_path, tmp_path / "model")
    config = os.path.join(path, "config.json")
    with open(config, "a") as f:
        f.write("}{")
    with pytest.raises(ValueError, match="is not valid JSON") as err:
        make_llm(path, num_kvcache_blocks=8)
    assert config in str(err.value)


def test_float_block_size(tiny_path):
    """Before: kvcache_block_size=16.0 -> TypeError: unsupported operand type(s) for &."""
    with pytest.raises(TypeError,
                       match=r"^kvcache_block_size=16.0 must be a power of two \(an int"):
        make_llm(tiny_path, kvcache_block_size=16.0)


TRITON_ON_CPU = """
import sys
from nanovllm import LLM
LLM(sys.argv[1], skip_tokenizer_init=True, attn_backend="triton", device="cpu",
    num_kvcache_blocks=8)
"""


def test_triton_on_cpu_without_interpreter_is_refused_at_build(tiny_path):
    """Before: the engine was built, and the first step failed with "RuntimeError: 0 active drivers
    ([]). There should only be one." (a fresh process: the interpreter flag is read at import)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = run_python(TRITON_ON_CPU, tiny_path, env=env)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError") and "TRITON_INTERPRET=1" in last and "sdpa" in last, last


@pytest.mark.slow
def test_cpu_bench_command_runs():
    """The README's CPU benchmark, smaller. Before: prompts of randint(100, --max-input-len)
    tokens, an empty range below 100 (ValueError: empty range for randrange())."""
    command = [sys.executable, "bench.py", "--attn-backend", "sdpa", "--arch", "SmolLM2-135M",
               "--num-seqs", "4", "--max-input-len", "32", "--max-output-len", "8"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one thread: a small model on shared cores
    result = subprocess.run(command, check=False, cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    row = result.stdout.strip().splitlines()[-1]
    assert row.startswith("| sdpa | ") and int(row.split("|")[2]) == 4 * 8  # 4 requests of 8 tokens


@pytest.mark.slow
def test_cpu_bench_repeats_each_configuration():
    """--repeat: every configuration runs again in a fresh engine; the medians come last."""
    command = [sys.executable, "bench.py", "--attn-backend", "sdpa", "--arch", "SmolLM2-135M",
               "--num-seqs", "2", "--max-input-len", "16", "--max-output-len", "4", "--repeat", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, check=False, cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    header = lines.index("| backend | output tokens | seconds | tokens/s | build s |")
    assert lines[header + 1] == "|---|---|---|---|---|"
    table = lines[header + 2:-2]  # the header first, each row once (they were printed twice)
    assert [line for line in lines if line.startswith("| sdpa")] == table, lines
    assert len(table) == 2 and all(row.startswith("| sdpa | 8 |") for row in table), lines
    rates = [float(row.split("|")[4].replace(",", "")) for row in table]
    assert all(float(row.split("|")[5]) > 0 for row in table)  # seconds for LLM(...)
    median = float(lines[-1].split("sdpa ")[1].split(" ")[0].replace(",", ""))
    assert lines[-1].startswith("median of 2 runs")
    assert median == pytest.approx(sum(rates) / 2, abs=1)
