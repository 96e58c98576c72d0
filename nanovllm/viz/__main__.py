"""`python -m nanovllm.viz run.json -o run.html`: draw a step trace as a self-contained page."""
import argparse
import os

from nanovllm.viz import write_page


def main():
    parser = argparse.ArgumentParser(prog="python -m nanovllm.viz", description=__doc__)
    parser.add_argument("trace", help="a trace file written by `with llm.trace(path)`")
    parser.add_argument("-o", "--output", help="the HTML file (default: the trace's name, .html)")
    args = parser.parse_args()
    output = args.output or os.path.splitext(args.trace)[0] + ".html"
    try:
        write_page(args.trace, output)
    except (OSError, ValueError) as e:  # a missing file, or not a trace (JSON errors too)
        parser.error(str(e))
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
