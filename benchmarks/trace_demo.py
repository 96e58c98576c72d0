"""Watch the paged KV cache work: trace a small scripted run and draw it as a page
(nanovllm/trace.py, nanovllm/viz). A tiny random Qwen3 on the CPU, a few seconds.

    python benchmarks/trace_demo.py                    # trace_demo.json, .html in a temporary dir
    python benchmarks/trace_demo.py --out DIR          # ... in DIR (not the repository's root)
    python benchmarks/trace_demo.py --swap             # preempt by swapping to the CPU pool instead
    python benchmarks/trace_demo.py --screenshots DIR  # also PNGs of key steps (headless Chromium)

The run, in four parts, each a picture of the vLLM paper: a prompt that a second request finds in
the prefix cache (it reuses the first one's blocks), parallel sampling (n=3: three samples share the
prompt's blocks and copy the last one on write, Figure 8), a beam search of width 3 (beams fork and
are let go, Figure 9), and more requests than the cache holds (the newest are preempted: their
blocks are freed and recomputed later, or swapped out and back in, section 4.5).
"""
import argparse
import os
import random
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __package__ in (None, ""):  # run as a script: the repository's nanovllm, not an installed one
    sys.path.insert(0, REPO)

from nanovllm import LLM, SamplingParams  # noqa: E402

# a small cache of small blocks, so that the grid is readable and the last part runs out of it
DEMO_OPTIONS = {"kvcache_block_size": 8, "num_kvcache_blocks": 48, "max_num_seqs": 8,
                "max_num_batched_tokens": 96, "skip_tokenizer_init": True, "device": "cpu",
                "attn_backend": "sdpa", "load_format": "safetensors"}
SWAP_OPTIONS = {"preemption_mode": "swap", "swap_space": 0.001}  # 1 MiB of CPU blocks


def tiny_qwen3(path: str) -> str:
    """A random Qwen3 (hidden 64, 2 layers, vocabulary 512, no EOS) saved in path."""
    import torch
    import transformers
    config = transformers.Qwen3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).save_pretrained(path)
    return path


def run_workload(llm: LLM):
    """The scripted run: a prefix-cache hit (a partial and a full one), n=3 sampling, a width-3 beam
    search, then more requests than the cache holds."""
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(512) for _ in range(n)]

    def greedy(max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    system = prompt(36)  # a shared prefix: 4 full blocks and a partial one
    llm.generate([system + prompt(4)], greedy(6), use_tqdm=False)
    sampled = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=12, ignore_eos=True)
    llm.generate([system + prompt(9), system[:32], prompt(14)], [greedy(6), greedy(4), sampled],
                 use_tqdm=False)  # a partial hit, a full hit (4 blocks), 3 samples
    llm.beam_search([prompt(11)], beam_width=3, max_tokens=10)
    llm.generate([prompt(rng.randint(20, 40)) for _ in range(6)], greedy(40), use_tqdm=False)


def output_dir(out: str) -> str:
    """The directory the demo writes into: `out` (created if need be), or a new temporary one;
    never the repository's root."""
    if not out:
        return tempfile.mkdtemp(prefix="trace_demo-")
    if os.path.realpath(out) == os.path.realpath(REPO):
        raise ValueError(f"--out {out!r} is the repository's root: give another directory")
    os.makedirs(out, exist_ok=True)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", metavar="DIR", default="",
                        help="writes DIR/trace_demo.json and .html (default: a new temporary dir)")
    parser.add_argument("--swap", action="store_true",
                        help="preempt by swapping blocks to the CPU pool")
    parser.add_argument("--screenshots", metavar="DIR",
                        help="PNGs of key steps, taken in headless Chromium")
    args = parser.parse_args()
    out = output_dir(args.out)
    json_path = os.path.join(out, "trace_demo.json")
    html_path = os.path.join(out, "trace_demo.html")
    import torch
    torch.set_num_threads(1)  # a tiny model: one thread beats several that spin-wait
    with tempfile.TemporaryDirectory() as model_dir:
        options = {**DEMO_OPTIONS, **(SWAP_OPTIONS if args.swap else {})}
        llm = LLM(tiny_qwen3(model_dir), **options)
        start = time.perf_counter()
        with llm.trace(json_path) as trace:
            run_workload(llm)
        seconds = time.perf_counter() - start
    from nanovllm.viz import write_page
    write_page(json_path, html_path)
    steps = trace.data["steps"]
    kinds = {}
    for entry in steps:
        for event in entry["events"]:
            kinds[event[0]] = kinds.get(event[0], 0) + 1
    print(f"{len(steps)} steps traced in {seconds:.1f} s: "
          + ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items())))
    print(f"wrote {json_path} and {html_path} (open it in a browser)")
    if args.screenshots:
        # the repository's tests drive Chromium through selenium
        from tests.browser import take_screenshots
        for path in take_screenshots(html_path, trace.data, args.screenshots):
            print("wrote", path)


if __name__ == "__main__":
    main()
