"""`python -m nanovllm.viz run.json -o run.html`: draw a step trace as a self-contained page.

A trace the page cannot draw (see nanovllm/viz/check.py) is refused: one line on stderr, exit
status 2, and no page written."""
import argparse
import os
import sys

from nanovllm.viz import write_page


def main():
    parser = argparse.ArgumentParser(prog="python -m nanovllm.viz",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="a trace file written by `with llm.trace(path)`")
    parser.add_argument("-o", "--output", help="the HTML file (default: the trace's name, .html)")
    args = parser.parse_args()
    output = args.output or os.path.splitext(args.trace)[0] + ".html"
    try:
        write_page(args.trace, output)
    except (OSError, ValueError) as e:  # a missing file, not JSON, or not a trace it can draw
        print(f"{parser.prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
