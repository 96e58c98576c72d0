"""benchmarks/host_step.py runs against the engine as it is: every phase it times is still there and
the CUDA-only parts it calls accept the engine's step inputs (no timing is asserted)."""
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
