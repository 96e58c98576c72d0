"""The `nanovllm` console command: `nanovllm serve MODEL [flags]` runs the OpenAI-compatible
server (nanovllm/serve/)."""
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "serve":
        print("usage: nanovllm serve MODEL [flags]   (nanovllm serve --help for the flags)",
              file=sys.stderr)
        return 2
    from nanovllm.serve.cli import main as serve
    return serve(argv[1:])
