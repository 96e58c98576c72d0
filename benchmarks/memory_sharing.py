"""Memory saved by sharing KV blocks, in the style of the vLLM paper's Figure 15.

On a fixed workload, after every engine step, count the KV blocks the live sequences hold with
sharing (distinct blocks in use) and without it (the sum of their block tables: every sample or
beam with its own copy of the prompt's blocks and of a parent's blocks). Prefix caching is off, so
that only the sharing of parallel sampling and beam search counts. Prints a markdown table.

    python benchmarks/memory_sharing.py              # a tiny random model on CPU, in seconds
    python benchmarks/memory_sharing.py --model DIR  # any checkpoint (only token counts matter)
"""
import argparse
import platform
import random
import tempfile

import torch

from nanovllm import LLM, SamplingParams


def tiny_model(path: str) -> str:
    """A random Llama (hidden 64, 2 layers, vocabulary 512, no EOS) saved in path."""
    import transformers
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=2048,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def measure(llm: LLM, run) -> tuple[int, int]:
    """Block-steps (blocks held, summed over steps) with and without sharing while run() drives
    the engine."""
    shared = private = 0
    step = llm.step

    def counting_step():
        nonlocal shared, private
        out = step()
        shared += len(llm.block_manager.blocks) - llm.block_manager.num_free_blocks
        private += sum(len(seq.block_table) for seq in llm.scheduler.running)
        return out
    llm.step = counting_step  # beam_search and generate both call self.step()
    try:
        run()
    finally:
        del llm.step
    return shared, private


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(100, 300))
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = args.model or tiny_model(tempfile.mkdtemp(prefix="nanovllm-tiny-"))
    llm = LLM(model, skip_tokenizer_init=True, enable_prefix_caching=False,
              kvcache_block_size=args.block_size, num_kvcache_blocks=4096,
              load_format="safetensors")
    rng = random.Random(0)
    vocab = llm.config.hf_config["vocab_size"]
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(*args.prompt_len))]
               for _ in range(args.num_prompts)]
    rows = []
    for n in (2, 4, 6):
        params = SamplingParams(n=n, temperature=1.0, seed=0, max_tokens=args.max_tokens,
                                ignore_eos=True)
        counts = measure(llm, lambda: llm.generate(prompts, params, use_tqdm=False))
        rows.append(("parallel sampling", f"n = {n}", *counts))
    for w in (2, 4, 6):
        counts = measure(llm, lambda: llm.beam_search(prompts, beam_width=w,
                                                      max_tokens=args.max_tokens))
        rows.append(("beam search", f"width = {w}", *counts))
    device = (torch.cuda.get_device_name() if llm.config.device == "cuda"
              else f"CPU ({platform.machine()})")
    print(f"{args.num_prompts} prompts of {args.prompt_len[0]}-{args.prompt_len[1]} tokens, "
          f"{args.max_tokens} new tokens, blocks of {args.block_size} tokens; {device}\n")
    print("| decoding | | KV blocks held, with sharing | without sharing | memory saved |")
    print("|---|---|---:|---:|---:|")
    for name, width, shared, private in rows:
        print(f"| {name} | {width} | {shared:,} | {private:,} | {1 - shared / private:.1%} |")
    print("\nKV blocks held: summed over engine steps (block-steps).")


if __name__ == "__main__":
    main()
