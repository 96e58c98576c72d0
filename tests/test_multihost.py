"""Tensor parallelism across hosts: two torchrun "hosts" on 127.0.0.1 (one rank each, gloo on CPU)
give the greedy tokens of one rank; rank 0 alone runs the rest of the script; a WORLD_SIZE that is
not tensor_parallel_size is refused."""
import json
import os
import socket
import subprocess
import sys

import pytest

from nanovllm import LLM, SamplingParams
from tests.helpers import build_random_checkpoint

pytestmark = pytest.mark.slow  # the quick subset, -m "not slow", leaves it out

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPTIONS = dict(skip_tokenizer_init=True, device="cpu", attn_backend="sdpa", kvcache_block_size=16,
               num_kvcache_blocks=64, max_num_batched_tokens=32)
PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 50)), [7] * 20]
GREEDY = dict(temperature=0, max_tokens=12, ignore_eos=True)
# the same script as on one rank: rank 0 alone gets past LLM(...)
SCRIPT = """
import json, os, sys
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


def run_two_hosts(script: str, args: list[str], timeout: float = 120) -> list[tuple[int, str]]:
    """Run script under two torchrun processes, each a "host" of one rank; their exit statuses
    and outputs (stdout and stderr)."""
    endpoint = f"127.0.0.1:{free_port()}"
    # one thread a rank: the two ranks share this machine's cores
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
         "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
         "--max-restarts", "0", script, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env=env, cwd=ROOT) for node in range(2)]
    try:
        outputs = [proc.communicate(timeout=timeout)[0] for proc in procs]
        return [(proc.returncode, output) for proc, output in zip(procs, outputs)]
    finally:
        for proc in procs:  # a host still running after the timeout: stopped
            if proc.poll() is None:
                proc.kill()
                proc.wait()


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
