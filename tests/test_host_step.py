"""benchmarks/host_step.py runs against the engine as it is: every phase it times is still there and
the CUDA-only parts it calls accept the engine's step inputs (no timing is asserted)."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_host_step_times_every_part():
    result = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "host_step.py"),
                             "--workload", "random", "--batch", "8", "--context", "40", "--steps", "2"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    names = ["schedule", "step_inputs", "update", "outputs", "cuda_graphs.upload", "cuda_graphs.unpack",
             "plan_tiles", "SamplingTensors.of", "sum"]
    for name in names:
        assert any(name in row for row in rows), (name, result.stdout)
    assert "8 decode rows" in result.stdout


def test_persistent_inputs_estimate_builds_the_engines_upload():
    """benchmarks/persistent_inputs.py's arrays, advanced one step, must equal the engine's own
    graph upload of that step (it asserts so before timing)."""
    script = os.path.join(REPO, "benchmarks", "persistent_inputs.py")
    result = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "256 decode rows" in result.stdout


AUDITED = r'''
import sys, tempfile
from collections import Counter
from dataclasses import replace
sys.path.insert(0, sys.argv[1])
import host_step
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
    prompts, params = host_step.requests("n8", 0, 0, 40)
    for prompt, p in list(zip(prompts, params))[:4]:
        llm.add_request(prompt[:300], replace(p, output_kind="final"))
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
    result = subprocess.run([sys.executable, "-c", AUDITED, os.path.join(REPO, "benchmarks")],
                            capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    events = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(events) <= {"array.__new__"}, events
