"""The server under load on a CPU: 64 concurrent streaming clients complete, each stream
adding up to its non-streamed greedy text; resident memory after 2,000 requests stays within 10%
of what it was after the first 100. A random model with SmolLM2's vocabulary keeps steps short."""
import asyncio
import json
import random

import httpx
import pytest

from tests.serve_helpers import SMALL_ENGINE, Server, build_random_smol

pytestmark = pytest.mark.slow  # the quick subset, -m "not slow", leaves it out

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_dir):
    path = build_random_smol(str(tmp_path_factory.mktemp("random_smol")))
    srv = Server(path, *SMALL_ENGINE, "--tokenizer", smollm2_dir)
    yield srv
    srv.kill()


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 20000) for _ in range(rng.randint(2, 24))] for _ in range(n)]


async def complete(client: httpx.AsyncClient, prompt: list[int], max_tokens: int,
                   stream: bool) -> str:
    """The greedy text of one prompt, whole or added up from its stream (which must end well)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    if not stream:
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    text, finish, done = "", None, False
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                choice = json.loads(line[6:])["choices"][0]
                text, finish = text + choice["text"], choice["finish_reason"] or finish
    assert done and finish == "length"
    return text


async def many(server: Server, prompts: list, max_tokens: int, stream: bool,
               concurrency: int) -> list[str]:
    """Every prompt, at most `concurrency` at a time."""
    limit = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=600,
                                 limits=limits, trust_env=False) as client:
        async def one(prompt):
            async with limit:
                return await complete(client, prompt, max_tokens, stream)
        return await asyncio.gather(*(one(p) for p in prompts))


def test_64_concurrent_streams_add_up(server):
    batch = prompts(64, seed=1)
    streamed = asyncio.run(many(server, batch, 32, stream=True, concurrency=64))
    whole = asyncio.run(many(server, batch, 32, stream=False, concurrency=64))
    assert streamed == whole and all(streamed)
    stats = server.wait_drained()
    assert stats["kv_blocks_used"] == 0


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


def test_memory_flat_over_2000_requests(server):
    batch = prompts(2000, seed=2)
    for stream in (True, False):  # the first 100: both paths warmed up
        asyncio.run(many(server, batch[:50], 4, stream=stream, concurrency=16))
    after_100 = rss_kib(server.proc.pid)
    for start in range(100, 2000, 100):
        asyncio.run(many(server, batch[start:start + 100], 4, stream=start % 200 == 0,
                         concurrency=16))
    after_2000 = rss_kib(server.proc.pid)
    assert abs(after_2000 - after_100) <= 0.1 * after_100, (after_100, after_2000)
