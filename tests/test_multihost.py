"""Tensor parallelism across hosts: two torchrun "hosts" on 127.0.0.1 (one rank each, gloo on CPU)
give the greedy tokens of one rank; rank 0 alone runs the rest of the script, or serves HTTP; a
WORLD_SIZE that is not tensor_parallel_size is refused; benchmarks/tp_check.py --torchrun, the GPU
measurement, runs its whole flow."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading

import httpx
import pytest

from benchmarks.tp_check import children, stop
from nanovllm import LLM, SamplingParams
from tests.helpers import build_random_checkpoint
from tests.serve_helpers import build_random_smol

pytestmark = pytest.mark.slow  # the quick subset, -m "not slow", leaves it out

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPTIONS = dict(skip_tokenizer_init=True, device="cpu", attn_backend="sdpa", kvcache_block_size=16,
               num_kvcache_blocks=64, max_num_batched_tokens=32)
PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 50)), [7] * 20]
GREEDY = dict(temperature=0, max_tokens=12, ignore_eos=True)
# the same script as on one rank: rank 0 alone gets past LLM(...)
SCRIPT = """
import json, os, sys
from benchmarks.tp_check import children, stop
from nanovllm import LLM, SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=2, **json.loads(sys.argv[2]))
out = llm.generate(json.loads(sys.argv[3]), SamplingParams(**json.loads(sys.argv[4])),
                   use_tqdm=False)
print("RANK", os.environ["RANK"], "TOKENS", json.dumps([o["token_ids"] for o in out]), flush=True)
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("qwen3"))
    build_random_checkpoint("qwen3", path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_two_hosts(*args: str) -> list[subprocess.Popen]:
    """`torchrun ... *args` twice, each a "host" of one rank, meeting on a free port."""
    endpoint = f"127.0.0.1:{free_port()}"
    # one thread a rank: the two ranks share this machine's cores
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("NANOVLLM_API_KEY", None)
    return [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
         "--max-restarts", "0", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env=env, cwd=ROOT) for node in range(2)]


def run_two_hosts(script: str, args: list[str], timeout: float = 120) -> list[tuple[int, str]]:
    """Run script on two torchrun "hosts"; their exit statuses and outputs (stdout and stderr)."""
    procs = start_two_hosts(script, *args)
    try:
        outputs = [proc.communicate(timeout=timeout)[0] for proc in procs]
        return [(proc.returncode, output) for proc, output in zip(procs, outputs)]
    finally:
        for proc in procs:  # a host still running after the timeout
            stop(proc)


def test_two_hosts_give_the_tokens_of_one(model, tmp_path):
    expected = [o["token_ids"] for o in LLM(model, **OPTIONS).generate(
        PROMPTS, SamplingParams(**GREEDY), use_tqdm=False)]
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    results = run_two_hosts(str(script), [model, json.dumps(OPTIONS), json.dumps(PROMPTS),
                                          json.dumps(GREEDY)])
    for status, output in results:
        assert status == 0, output[-3000:]
    # rank 0 ran the script's generate call; rank 1 exited in LLM(...) after rank 0's shutdown
    lines = [line for _, output in results for line in output.splitlines()
             if line.startswith("RANK ")]
    assert lines == [f"RANK 0 TOKENS {json.dumps(expected)}"]


def test_world_size_other_than_tensor_parallel_size_is_refused(model, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="WORLD_SIZE=4 .*tensor_parallel_size=2"):
        LLM(model, tensor_parallel_size=2, **OPTIONS)
    with pytest.raises(ValueError, match="WORLD_SIZE=4 .*tensor_parallel_size=1"):
        LLM(model, **OPTIONS)


def test_serve_on_two_hosts(tmp_path, smollm2_dir):
    """`python -m nanovllm.serve` under torchrun: rank 0 serves (one server, the tokens of one
    rank), rank 1 runs its steps; SIGTERM to rank 0 stops both, each with status 0."""
    model = build_random_smol(str(tmp_path))
    flags = ["--tokenizer", smollm2_dir, "--device", "cpu", "--attn-backend", "sdpa",
             "--kvcache-block-size", "16", "--num-kvcache-blocks", "64"]
    body = dict(prompt="The capital of France is", max_tokens=8, temperature=0)
    with LLM(model, tokenizer=smollm2_dir, **{**OPTIONS, "skip_tokenizer_init": False}) as llm:
        expected = llm.generate(body["prompt"], SamplingParams(temperature=0, max_tokens=8),
                                use_tqdm=False)[0].outputs[0].text
    procs = start_two_hosts("-m", "nanovllm.serve", model, "--tensor-parallel-size", "2",
                            "--port", "0", "--log-level", "warning", *flags)
    logs = [[], []]
    url, serving = [], threading.Event()

    def read(node: int):
        for line in procs[node].stdout:
            logs[node].append(line)
            if line.startswith("nanovllm: serving "):
                url.append((node, line.rsplit(" on ", 1)[1].strip()))
                serving.set()

    readers = [threading.Thread(target=read, args=(node,), daemon=True) for node in range(2)]
    for reader in readers:
        reader.start()
    try:
        assert serving.wait(120), "".join(logs[0] + logs[1])[-3000:]
        node, address = url[0]
        with httpx.Client(base_url=address, trust_env=False, timeout=60) as http:
            answer = http.post("/v1/completions", json=body).json()
        assert answer["choices"][0]["text"] == expected
        for rank0 in children(procs[node].pid):  # rank 0's process, torchrun's child
            os.kill(rank0, signal.SIGTERM)
        statuses = [proc.wait(60) for proc in procs]
        for reader in readers:
            reader.join(10)
    finally:
        for proc in procs:
            stop(proc)
    assert statuses == [0, 0], "".join(logs[0] + logs[1])[-3000:]
    assert len(url) == 1  # rank 1 started no server
    assert any(line.startswith("nanovllm: stopped") for line in logs[node])


def test_a_local_rank_without_its_gpu_is_refused(model, monkeypatch):
    """Under torchrun a rank needs cuda:LOCAL_RANK on its own host, not N GPUs there."""
    import torch
    for name, value in (("RANK", "1"), ("LOCAL_RANK", "1"), ("WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    options = {**OPTIONS, "device": "cuda", "attn_backend": "triton"}
    with pytest.raises(ValueError, match="LOCAL_RANK=1 needs cuda:1 but only 1 GPU"):
        LLM(model, tensor_parallel_size=2, **options)


def test_the_workers_end_when_rank_0_dies(model, tmp_path):
    """Rank 0 killed while the others wait for a step: they fail instead of waiting forever."""
    script = tmp_path / "script.py"
    script.write_text("import json, os, signal, sys\nfrom nanovllm import LLM\n"
                      "llm = LLM(sys.argv[1], tensor_parallel_size=2, **json.loads(sys.argv[2]))\n"
                      "print('RANK', os.environ['RANK'], 'KILLED', flush=True)\n"
                      "os.kill(os.getpid(), signal.SIGKILL)\n")
    results = run_two_hosts(str(script), [model, json.dumps(OPTIONS)], timeout=60)
    assert sorted(status != 0 for status, _ in results) == [True, True]
    lines = [line for _, output in results for line in output.splitlines()
             if line.startswith("RANK ")]
    assert lines == ["RANK 0 KILLED"]


def test_tp_check_compares_local_workers_with_two_hosts(tmp_path):
    """The GPU command `benchmarks/tp_check.py --torchrun`, on CPU: the local launch and the two
    torchrun hosts it starts agree token for token and in every log-probability."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    r = subprocess.run([sys.executable, "benchmarks/tp_check.py", "--torchrun", "--tiny",
                        "--model-dir", str(tmp_path / "tp-check"),
                        "--num-prompts", "4", "--repeat", "1"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "| torchrun, 2 hosts | 64 |" in r.stdout
    assert "tokens equal: yes (64/64 tokens, 4/4 sequences" in r.stdout
    assert "equal: yes (largest difference 0)" in r.stdout
