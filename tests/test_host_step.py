"""The host's work per decode step. `benchmarks/profile_step.py --host` runs against the engine as
it is: every phase it times is still there and the CUDA-only parts it calls accept the engine's
step inputs (no timing is asserted). Decode steps raise no audit event per sequence."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # the quick subset, -m "not slow", leaves it out

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_profile_step_times_every_part_of_the_host_work():
    result = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "profile_step.py"),
                             "--host", "--batch", "8", "--context", "40", "--steps", "2"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    names = ["schedule", "step_inputs", "update", "outputs", "cuda_graphs.upload",
             "cuda_graphs.unpack", "plan_tiles", "SamplingTensors.of", "sum"]
    for name in names:
        assert any(name in row for row in rows), (name, result.stdout)
    assert "8 decode rows" in result.stdout


AUDITED = r'''
import sys, tempfile
from collections import Counter
from dataclasses import replace
sys.path.insert(0, sys.argv[1])
from bench import sharing_requests
from transformers import Qwen3Config, Qwen3ForCausalLM
from nanovllm import LLM
events, on = Counter(), [False]
sys.addaudithook(lambda event, args: on[0] and events.update([event]))
config = Qwen3Config(vocab_size=10001, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=16, num_key_value_heads=8, head_dim=8)
with tempfile.TemporaryDirectory() as path:
    Qwen3ForCausalLM(config).save_pretrained(path)
    llm = LLM(path, skip_tokenizer_init=True, num_kvcache_blocks=200, device="cpu",
              async_scheduling=True)
    prompts, params = sharing_requests("n8", max_tokens=40)
    for prompt in prompts[:4]:
        llm.add_request(prompt[:300], replace(params, output_kind="final"))
    for _ in range(6):
        llm.step()
    on[0] = True
    for _ in range(5):
        llm.step()
    on[0] = False
import json
print(json.dumps(events))
'''


def test_decode_steps_raise_no_audit_event_per_sequence():
    """An audit hook makes every audited call a Python call (filelock, imported by transformers and
    torch's compiler, installs one on Python >= 3.12; `id()` is audited): decode steps of n-sample
    requests must not make one per sequence. Steady steps here raise none but the upload's array."""
    result = subprocess.run([sys.executable, "-c", AUDITED, REPO],
                            capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    events = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(events) <= {"array.__new__"}, events
