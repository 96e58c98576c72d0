"""Tensor parallelism on CPU over gloo: the same greedy tokens as one rank, nothing left behind,
clear errors."""
import gc
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from nanovllm import LLM, SamplingParams
from nanovllm.layers.linear import Linear
from nanovllm.layers.tensor_parallel import ColumnParallel

pytestmark = pytest.mark.slow  # the quick subset, -m "not slow", leaves it out

# the 40-token prompt is prefilled in two chunks
OPTIONS = dict(skip_tokenizer_init=True, device="cpu", attn_backend="sdpa", kvcache_block_size=16,
               num_kvcache_blocks=64, max_num_batched_tokens=32)
# the last shares a block
PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 50)), [7] * 20, list(range(10, 26)) + [3, 4]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# vocab 301 is not divisible by 2 ranks: the last rank's vocabulary shard is padded.
# initializer_range 0.1 (not 0.02) keeps random logits apart, so summation order cannot flip a
# greedy pick.
DIMS = dict(vocab_size=301, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
            initializer_range=0.1)
MODELS = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(tie_word_embeddings=False)),
    "llama_tied": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=True)),
    # replicated on both ranks
    "qwen3_one_kv_head": (Qwen3Config, Qwen3ForCausalLM, dict(num_key_value_heads=1)),
}


def save_model(path: str, name: str) -> str:
    config_cls, model_cls, overrides = MODELS[name]
    torch.manual_seed(0)
    model_cls(config_cls(**{**DIMS, **overrides})).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    return {name: save_model(str(tmp_path_factory.mktemp(name)), name) for name in MODELS}


def greedy_tokens(llm: LLM) -> list[list[int]]:
    return [out["token_ids"] for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def is_running(pid: int) -> bool:
    """Whether the process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def live_children() -> list[int]:
    """Pids of this process's children that are still running (workers are subprocesses)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[1]) == os.getpid() and fields[0] not in ("Z", "X"):
                pids.append(int(entry))
    return pids


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        # connections in TIME_WAIT don't count
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
            return True
        except OSError:
            return False


@pytest.mark.parametrize("name", list(MODELS))
def test_two_ranks_give_the_tokens_of_one(models, name):
    expected = greedy_tokens(LLM(models[name], **OPTIONS))
    with LLM(models[name], tensor_parallel_size=2, **OPTIONS) as llm:
        assert len(live_children()) == 1
        assert greedy_tokens(llm) == expected
    assert live_children() == []


def test_shutdown_leaves_no_process_or_port(models):
    llm = LLM(models["qwen3"], tensor_parallel_size=2, **OPTIONS)
    pids, port = [p.pid for p in llm.workers.procs], llm.workers.port
    assert not port_is_free(port)
    llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    procs = llm.workers.procs
    llm.shutdown()
    llm.shutdown()  # twice is harmless
    # the worker stopped on rank 0's message, not by a signal
    assert [p.returncode for p in procs] == [0]
    assert live_children() == []
    assert not any(is_running(pid) for pid in pids)
    assert port_is_free(port)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)


def test_two_engines_side_by_side(models):
    expected = {name: greedy_tokens(LLM(models[name], **OPTIONS))
                for name in ("qwen3", "llama_tied")}
    a = LLM(models["qwen3"], tensor_parallel_size=2, **OPTIONS)
    b = LLM(models["llama_tied"], tensor_parallel_size=2, **OPTIONS)
    assert a.workers.port != b.workers.port
    a.add_request(PROMPTS[1], GREEDY)
    b.add_request(PROMPTS[1], GREEDY)
    while not (a.is_finished() and b.is_finished()):  # steps of the two engines interleave
        done_a = [o for o in a.step() if o.finished] if not a.is_finished() else []
        done_b = [o for o in b.step() if o.finished] if not b.is_finished() else []
        for out in done_a:
            assert out["token_ids"] == expected["qwen3"][1]
        for out in done_b:
            assert out["token_ids"] == expected["llama_tied"][1]
    assert greedy_tokens(a) == expected["qwen3"]
    del a  # collected without shutdown(): its worker stops all the same
    gc.collect()
    assert len(live_children()) == 1
    assert greedy_tokens(b) == expected["llama_tied"]
    b.shutdown()
    assert live_children() == []


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = """
import sys, time
from nanovllm import LLM
llm = LLM(sys.argv[1], tensor_parallel_size=2, **eval(sys.argv[2]))
print(*[p.pid for p in llm.workers.procs], flush=True)
time.sleep(120)
"""


def test_workers_die_with_the_engine_process(models):
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, models["qwen3"], repr(OPTIONS)],
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT})
    try:
        pids = [int(pid) for pid in proc.stdout.readline().split()]
        assert pids and all(is_running(pid) for pid in pids)
    finally:
        # no shutdown, no atexit: the worker must notice on its own
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 20
    while any(is_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(is_running(pid) for pid in pids)


def test_a_script_read_from_stdin_without_a_main_guard(models):
    """Workers are `python -m` processes: nothing re-imports the user's script (spawned workers
    would fail on a script read from stdin, and would run a script without
    `if __name__ == "__main__":` again)."""
    script = (f"from nanovllm import LLM, SamplingParams\n"
              f"llm = LLM({models['qwen3']!r}, tensor_parallel_size=2, **{OPTIONS!r})\n"
              f"out = llm.generate([{PROMPTS[1]!r}], "
              "SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), "
              f"use_tqdm=False)\nprint('TOKENS', out[0]['token_ids'])\n")
    expected = greedy_tokens(LLM(models["qwen3"], **OPTIONS))[1]
    result = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"TOKENS {expected}" in result.stdout


def test_a_dead_worker_fails_the_step_instead_of_hanging(models):
    llm = LLM(models["qwen3"], tensor_parallel_size=2, **OPTIONS)
    worker = llm.workers.procs[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait()
    with pytest.raises(RuntimeError):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    llm.shutdown()
    assert live_children() == []


def test_error_during_start_leaves_no_process(models, tmp_path):
    with open(os.path.join(models["qwen3"], "config.json")) as f:
        # a config but no weights: every rank fails to load
        (tmp_path / "config.json").write_text(f.read())
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(tmp_path), tensor_parallel_size=2, **OPTIONS)
    gc.collect()
    assert live_children() == []


@pytest.mark.parametrize("overrides, tp, match", [
    (dict(num_attention_heads=4), 3, "num_attention_heads=4"),
    (dict(num_attention_heads=6, num_key_value_heads=3, head_dim=8), 2, "num_key_value_heads=3"),
    (dict(intermediate_size=129), 2, "intermediate_size=129"),
])
def test_sizes_that_do_not_split_are_refused(tmp_path, overrides, tp, match):
    # config.json alone: refused before loading
    Qwen3Config(**{**DIMS, **overrides}).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=match):
        LLM(str(tmp_path), tensor_parallel_size=tp, **OPTIONS)
    assert live_children() == []


def test_more_ranks_than_gpus_is_refused(tmp_path, monkeypatch):
    Qwen3Config(**DIMS).save_pretrained(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    options = {**OPTIONS, "device": "cuda", "attn_backend": "triton"}
    with pytest.raises(ValueError, match="tensor_parallel_size=2 but only 1 GPU"):
        LLM(str(tmp_path), tensor_parallel_size=2, **options)


class FakeGroup:
    """What a layer asks of its group while it is built: its rank and the number of ranks."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


@pytest.mark.parametrize("num_kv_heads, tp", [(2, 4), (1, 2), (4, 2)])
def test_qkv_shards_replicate_kv_heads(num_kv_heads, tp):
    """Rank r holds query heads r*h..(r+1)*h-1 and the KV heads they attend to (shared
    when KV heads < ranks)."""
    hidden, head_dim, num_heads = 8, 2, 8
    q = torch.randn(num_heads * head_dim, hidden)
    k, v = torch.randn(2, num_kv_heads * head_dim, hidden)
    q_bias, k_bias, v_bias = (torch.randn(num_heads * head_dim),
                              *torch.randn(2, num_kv_heads * head_dim))
    # query heads per KV head
    heads_per_rank, group_size = num_heads // tp, num_heads // num_kv_heads
    for rank in range(tp):
        full = Linear(hidden,
                      [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
                      bias=True)
        replicas = max(1, tp // num_kv_heads)
        layer = ColumnParallel(full, FakeGroup(rank, tp), [1, replicas, replicas])
        for param, parts in ((layer.weight, (q, k, v)), (layer.bias, (q_bias, k_bias, v_bias))):
            for part, loaded in enumerate(parts):
                param.weight_loader(param, loaded, part)
        first_head = rank * heads_per_rank
        kv_head = first_head // group_size
        local_kv = max(1, num_kv_heads // tp)
        rows = lambda t, head, n: t[head * head_dim:(head + n) * head_dim]  # noqa: E731
        expect_w = torch.cat([rows(q, first_head, heads_per_rank), rows(k, kv_head, local_kv),
                              rows(v, kv_head, local_kv)])
        expect_b = torch.cat([rows(q_bias, first_head, heads_per_rank),
                              rows(k_bias, kv_head, local_kv), rows(v_bias, kv_head, local_kv)])
        assert torch.equal(layer.weight, expect_w)
        assert torch.equal(layer.bias, expect_b)
