"""Where a decode step of bench.py's sharing workloads spends its GPU time, cascade on and off:
`python benchmarks/cascade_profile.py --workload shared-prefix n8` (from the repository root, with
PYTHONPATH=.).

For each workload and setting it queues the workload (bench.py's `sharing_requests`), runs steps
until every sequence decodes and `--skip` more, then profiles `--steps` decode steps with
torch.profiler and prints the wall time and GPU busy time per step and the GPU time of each kernel
(benchmarks/profile_step.py's report).
"""
import argparse
import os
import sys
import time

from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import release, sharing_requests  # noqa: E402
from profile_step import instrument, report  # noqa: E402

from nanovllm import LLM  # noqa: E402

ARCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "Qwen3-0.6B")


def profile_workload(workload: str, cascade: bool, steps: int, skip: int):
    llm = LLM(ARCH, load_format="dummy", skip_tokenizer_init=True, attn_backend="triton",
              max_model_len=4096, disable_cascade_attn=not cascade)
    llm.generate(*sharing_requests(workload, seed_value=1, max_tokens=4), use_tqdm=False)
    prompts, params = sharing_requests(workload, max_tokens=skip + 3 * steps + 64)
    for prompt in prompts:
        llm.add_request(prompt, params)
    runner = llm.model_runner
    decoding = 0
    while decoding < skip:  # prefill, then `skip` steps of decodes only
        llm.step()
        running = llm.scheduler.running
        decoding = decoding + 1 if all(s.num_computed_tokens >= s.num_prompt_tokens
                                       for s in running) and not llm.scheduler.waiting else 0
    start = time.perf_counter()
    for _ in range(steps):
        llm.step()
    wall = (time.perf_counter() - start) / steps * 1e6
    phases = instrument(llm)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            with record_function("step"):
                llm.step()
    cascade_obj = getattr(runner.backend, "cascade", None)
    used = cascade_obj.num_steps if cascade_obj is not None else 0
    report(prof, steps, wall, wall, phases,
           f"{workload}, cascade {'on' if cascade else 'off'} ({used} cascade steps so far), "
           f"batch {len(llm.scheduler.running)}")
    release(llm)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", nargs="+", default=["shared-prefix", "n8"])
    parser.add_argument("--cascade", nargs="+", default=["on", "off"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--skip", type=int, default=100, help="decode steps before the profile")
    args = parser.parse_args()
    for workload in args.workload:
        for cascade in args.cascade:
            profile_workload(workload, cascade == "on", args.steps, args.skip)


if __name__ == "__main__":
    main()
