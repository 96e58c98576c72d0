"""The reading path: what a learner must read to follow one greedy request (`python benchmarks/reading_path.py`).

It runs `LLM(path).generate([prompt], SamplingParams(temperature=0))` on the CPU with the sdpa backend
in a fresh interpreter, on a small random Qwen3 checkpoint saved by transformers, lists the nanovllm
modules that request imported, and counts their code lines: no blank, comment or docstring lines
(the rule of ../shared/hooks/measure.py). Modules a first reading can skip (tensor parallelism, swap,
beam search, CUDA graphs, kernels, streaming, the server, ...) are not imported by such a request, so
they are not counted. `--markdown` prints the table for the README; `--limit N` exits 1 above N.
"""
import argparse
import ast
import io
import json
import os
import subprocess
import sys
import tempfile
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = r"""
import json, sys
from nanovllm import LLM, SamplingParams
llm = LLM(sys.argv[1], kvcache_block_size=16, num_kvcache_blocks=64, skip_tokenizer_init=True)
out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
assert len(out[0].outputs[0].token_ids) == 8
print(json.dumps(sorted(m.__file__ for name, m in sys.modules.items()
                        if name.split(".")[0] == "nanovllm" and getattr(m, "__file__", None))))
"""


def code_lines(source: str) -> int:
    """Lines holding code: not blank, not only a comment, not part of a docstring."""
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENDMARKER)
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skip:
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - docstrings)


def imported_modules() -> list[str]:
    """The files of the nanovllm modules one greedy CPU request imports."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    config = Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64)
    with tempfile.TemporaryDirectory() as path:
        torch.manual_seed(0)
        Qwen3ForCausalLM(config).save_pretrained(path)
        env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        result = subprocess.run([sys.executable, "-c", CHILD, path], capture_output=True, text=True, env=env)
    if result.returncode:
        raise RuntimeError(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--markdown", action="store_true", help="a table for the README")
    parser.add_argument("--limit", type=int, default=0, help="exit with status 1 above this many lines")
    args = parser.parse_args()
    rows = [(os.path.relpath(f, ROOT), code_lines(open(f).read())) for f in imported_modules()]
    total = sum(n for _, n in rows)
    if args.markdown:
        print("| module | code lines |\n|---|---:|")
        print("\n".join(f"| {name} | {n} |" for name, n in rows if n))
        print(f"| **{len(rows)} modules** | **{total:,}** |")
    else:
        print("\n".join(f"{n:5d}  {name}" for name, n in rows))
        print(f"{total:5d}  in {len(rows)} modules")
    if args.limit and total > args.limit:
        sys.exit(f"the reading path has {total} code lines, more than {args.limit}")


if __name__ == "__main__":
    main()
