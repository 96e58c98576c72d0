"""Test helpers for the OpenAI-compatible server: a live `python -m nanovllm.serve` process on
127.0.0.1 (a port the OS picks), its address and key, and a random model that speaks SmolLM2's
vocabulary (served with `--tokenizer`), for tests that need many fast steps rather than good text.
"""
import json
import os
import subprocess
import sys
import threading
import time

import httpx
import torch

from tests.helpers import RANDOM_BASE, RANDOM_MODELS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "test-key"
SMOL_VOCAB = 49152
SMALL_ENGINE = ("--kvcache-block-size", "16", "--num-kvcache-blocks", "512", "--max-model-len",
                "1024", "--max-num-seqs", "64")


class Server:
    """A server process; `url` once it listens. Its output is kept in `log` for failures."""

    def __init__(self, model: str, *flags: str, api_key: str | None = KEY, timeout: float = 300):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        env.pop("NANOVLLM_API_KEY", None)
        key = ("--api-key", api_key) if api_key else ()
        self.api_key = api_key
        self.proc = subprocess.Popen([sys.executable, "-m", "nanovllm.serve", model, "--port", "0",
                                      "--log-level", "warning", *key, *flags],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, cwd=ROOT)
        self.log: list[str] = []
        self.url = None
        ready = threading.Event()
        threading.Thread(target=self._read, args=(ready,), daemon=True).start()
        if not ready.wait(timeout) or self.url is None:
            self.kill()
            raise RuntimeError("the server did not start:\n" + "".join(self.log[-40:]))

    def _read(self, ready: threading.Event):
        for line in self.proc.stdout:
            self.log.append(line)
            if self.url is None and line.startswith("nanovllm: serving "):
                self.url = line.rsplit(" on ", 1)[1].strip()
                ready.set()
        ready.set()  # the process ended

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **options) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, trust_env=False,
                            timeout=options.pop("timeout", 300), **options)

    def openai(self, **options):
        import openai
        options = {"api_key": self.api_key or "none", "timeout": 300, **options}
        return openai.OpenAI(base_url=self.url + "/v1", http_client=httpx.Client(trust_env=False),
                             max_retries=0, **options)

    def stats(self) -> dict:
        with self.client() as c:
            return c.get("/v1/stats").json()

    def wait_drained(self, timeout: float = 60) -> dict:
        """The engine's figures once nothing runs or waits (what an abort must leave)."""
        end = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if (stats["num_running"] == stats["num_waiting"] == stats["kv_blocks_used"] == 0
                    or time.monotonic() > end):
                return stats
            time.sleep(0.1)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def build_random_smol(path: str) -> str:
    """A random 2-layer Qwen3 checkpoint with SmolLM2's vocabulary (tests/helpers.py's random
    model, wider vocabulary): served with --tokenizer SMOLLM2_DIR, a step costs milliseconds on a
    CPU, and its large random weights keep greedy choices clear of rounding."""
    import transformers
    config = transformers.Qwen3Config(**{**RANDOM_BASE, **RANDOM_MODELS["qwen3"][1],
                                         "vocab_size": SMOL_VOCAB})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    return path


def sse_events(response: httpx.Response) -> list:
    """The JSON events of a server-sent-event stream, up to [DONE] (which must end it)."""
    events = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        if line == "data: [DONE]":
            return events
        events.append(json.loads(line[6:]))
    raise AssertionError("the stream ended without data: [DONE]")
