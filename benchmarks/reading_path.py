"""The reading path: what a learner reads to follow one greedy request
(`python benchmarks/reading_path.py`).

Two paths, counted in code lines (no blank, comment or docstring lines; ../shared/hooks/measure.py's
rule) of the nanovllm modules they load, imports inside functions included:

- cpu path: `LLM(path).generate([prompt], SamplingParams(temperature=0))` runs on the CPU (sdpa)
  in a fresh interpreter, on a small random Qwen3 checkpoint saved by transformers; the modules it
  loaded are counted.
- cuda path: the same request on the default CUDA configuration (triton, CUDA graphs, run-ahead,
  cascade), which a CPU cannot run: counted statically, as every module reachable by the imports
  of nanovllm.llm and of the default backend, top-level or inside a function, except the modules
  of OPTIONAL_FEATURES, which such a request never loads. tests/test_gpu.py checks this set against
  what a real request on a GPU loads. kernels/ is counted apart, a chapter of its own.

`--limit CPU CUDA` exits 1 when a path has more lines than its limit; `--list` prints every module.
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
PACKAGE = os.path.join(ROOT, "nanovllm")
CHILD = r"""
import json, sys
from nanovllm import LLM, SamplingParams
llm = LLM(sys.argv[1], skip_tokenizer_init=True, **json.loads(sys.argv[2]))
out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
assert len(out[0].outputs[0].token_ids) == 8
print(json.dumps(sorted(name for name, m in sys.modules.items()
                        if name.split(".")[0] == "nanovllm" and getattr(m, "__file__", None))))
"""
# where a request on the default CUDA configuration starts reading: the public entry point, and the
# default backend (attention.get_backend imports it by name)
CUDA_ROOTS = ("nanovllm", "nanovllm.llm", "nanovllm.attention.triton")
# features a default greedy request does not use: they are imported only when asked for
OPTIONAL_FEATURES = {
    "nanovllm.cli", "nanovllm.trace", "nanovllm.serve", "nanovllm.viz",  # tools and the server
    "nanovllm.attention.flash", "nanovllm.attention.sdpa",  # the other backends
    "nanovllm.attention.fp8",                               # kv_cache_dtype="fp8"
    "nanovllm.worker.piecewise_graph",                      # backends not captured whole
    "nanovllm.worker.distributed", "nanovllm.worker.tp_worker",  # tensor_parallel_size > 1
    "nanovllm.worker.torchrun",                             # started by torchrun
    "nanovllm.layers.tensor_parallel",
    "nanovllm.core.swap", "nanovllm.core.reservation",      # preemption_mode, kv_reservation
    "nanovllm.core.sharing", "nanovllm.engine.beam_search",  # n > 1, beam search
    "nanovllm.engine.streaming",                            # streamed text, stop strings
    "nanovllm.engine.tokenizer",                            # text (this request's are token ids)
    "nanovllm.engine.metrics", "nanovllm.engine.stats",     # log_stats, get_stats()
    "nanovllm.core.requeue",                                # aborts, steps that fail
    "nanovllm.layers.penalties", "nanovllm.layers.logprobs",  # per-request sampling options
    "nanovllm.layers.rope_scaling",                         # rope_scaling in config.json
    "nanovllm.utils.dummy_weights", "nanovllm.utils.fetch",  # load_format="dummy", example.py
}


def code_lines(source: str) -> int:
    """Lines holding code: not blank, not only a comment, not part of a docstring."""
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        if isinstance(node, kinds) and body:
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


def module_file(name: str) -> str | None:
    """The source file of a nanovllm module (a package's __init__.py), or None."""
    path = os.path.join(ROOT, *name.split("."))
    for candidate in (path + ".py", os.path.join(path, "__init__.py")):
        if os.path.isfile(candidate):
            return candidate
    return None


def imports(name: str) -> set[str]:
    """The nanovllm modules a module imports, anywhere in its source, with their parent packages."""
    found = set()
    for node in ast.walk(ast.parse(open(module_file(name)).read())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)  # `from package import module` names a module too
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    modules = {m for m in found if m.split(".")[0] == "nanovllm" and module_file(m)}
    parents = {m.rsplit(".", i)[0] for m in modules for i in range(1, m.count(".") + 1)}
    return modules | parents


def optional(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in OPTIONAL_FEATURES)


def cuda_modules() -> list[str]:
    """The modules a greedy request on the default CUDA configuration loads (see the docstring)."""
    seen, todo = set(), list(CUDA_ROOTS)
    while todo:
        name = todo.pop()
        if name not in seen and not optional(name):
            seen.add(name)
            todo += imports(name)
    return sorted(seen)


def loaded_modules(**options) -> list[str]:
    """The modules one greedy request loads, as it runs (on the CPU with device="cpu")."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    config = Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         max_position_embeddings=64)
    with tempfile.TemporaryDirectory() as path:
        torch.manual_seed(0)
        Qwen3ForCausalLM(config).save_pretrained(path)
        env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        result = subprocess.run([sys.executable, "-c", CHILD, path, json.dumps(options)],
                                capture_output=True, text=True, env=env)
    if result.returncode:
        raise RuntimeError(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def count(modules: list[str]) -> list[tuple[str, int]]:
    """(file, code lines) of each module."""
    files = [os.path.relpath(module_file(m), ROOT) for m in modules]
    return [(f, code_lines(open(os.path.join(ROOT, f)).read())) for f in files]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--limit", type=int, nargs=2, metavar=("CPU", "CUDA"),
                        help="exit with status 1 when a path has more code lines than this")
    parser.add_argument("--list", action="store_true", help="print every module and its lines")
    args = parser.parse_args()
    cpu = count(loaded_modules(device="cpu", kvcache_block_size=16, num_kvcache_blocks=64))
    cuda = count(cuda_modules())
    kernels = [(f, n) for f, n in cuda if f.startswith(os.path.join("nanovllm", "kernels"))]
    cuda = [row for row in cuda if row not in kernels]
    if args.list:
        for title, rows in (("cpu path", cpu), ("cuda path", cuda), ("kernels", kernels)):
            print(f"{title}:\n" + "\n".join(f"{n:6d}  {f}" for f, n in rows))
    paths = [("cpu path", cpu), ("cuda path", cuda)]
    for title, rows in paths:
        print(f"{title}: {sum(n for _, n in rows):,} code lines in {len(rows)} modules")
    print(f"kernels: {sum(n for _, n in kernels):,} code lines")
    totals = [(title, sum(n for _, n in rows)) for title, rows in paths]
    over = [f"the {title} has {total} code lines, more than {limit}"
            for (title, total), limit in zip(totals, args.limit or ()) if total > limit]
    if over:
        sys.exit("; ".join(over))


if __name__ == "__main__":
    main()
