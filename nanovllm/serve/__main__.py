"""`python -m nanovllm.serve MODEL [--host 127.0.0.1] [--port 8000] [engine flags]`."""
import sys

from nanovllm.serve.cli import main

if __name__ == "__main__":  # not in a replica's process (spawned: it imports this)
    sys.exit(main())
