"""Data-parallel replicas behind one server (nanovllm/serve/replicas.py), live on 127.0.0.1 with
`--data-parallel-size 2` and a random model that speaks SmolLM2's vocabulary: concurrent requests
spread over both replicas and match one engine's greedy text; prompts sharing a first KV block go to
one replica (whose prefix cache then serves them), or to both with `--routing least-loaded`; a
replica killed mid-run fails its requests, is named by /health, and leaves the other serving;
SIGTERM stops the server and every replica."""
import os
import signal
import threading
import time

import httpx
import pytest

from tests.helpers import make_llm
from tests.serve_helpers import SMALL_ENGINE, Server, sse_events

pytestmark = pytest.mark.slow  # the quick subset, -m "not slow", leaves it out

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

ENGINE = dict(kvcache_block_size=16, num_kvcache_blocks=512, max_model_len=1024, max_num_seqs=64)


@pytest.fixture(scope="module")
def server(random_smol, smollm2_dir):
    srv = Server(random_smol, *SMALL_ENGINE, "--tokenizer", smollm2_dir,
                 "--data-parallel-size", "2")
    yield srv
    srv.kill()


def routed(server: Server) -> list[int]:
    return [r["num_requests_routed"] for r in server.stats()["replicas"]]


def complete_all(server: Server, bodies: list[dict]) -> list[httpx.Response]:
    """The bodies posted to /v1/completions at once, one thread each."""
    responses = [None] * len(bodies)

    def post(i):
        with server.client(timeout=60) as c:
            responses[i] = c.post("/v1/completions", json=bodies[i])
    threads = [threading.Thread(target=post, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    return responses


def test_requests_spread_over_replicas_and_match_one_engine(server, random_smol, smollm2_dir):
    prompts = [[1000 + 37 * i + j for j in range(2 + i % 9)] for i in range(16)]  # < one block
    bodies = [{"prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
              for p in prompts]
    before = routed(server)
    responses = complete_all(server, bodies)
    assert all(r is not None and r.status_code == 200 for r in responses)
    counts = [after - b for after, b in zip(routed(server), before)]
    assert sum(counts) == 16 and min(counts) >= 4, counts  # both replicas served
    llm = make_llm(random_smol, tokenizer=smollm2_dir, skip_tokenizer_init=False, **ENGINE)
    from nanovllm import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [out.outputs[0].text for out in llm.generate(prompts, params, use_tqdm=False)]
    assert [r.json()["choices"][0]["text"] for r in responses] == expected
    assert [r.json()["usage"]["prompt_tokens"] for r in responses] == [len(p) for p in prompts]


def test_shared_prefix_goes_to_one_replica(server):
    """Requests sharing a first block (16 tokens) land on one replica even when sent at once,
    where the least loaded would spread them; that replica's prefix cache serves them."""
    prefix = list(range(2000, 2020))  # 20 tokens: a full block and some
    bodies = [{"prompt": prefix + [3000 + i, 3100 + i], "max_tokens": 8, "temperature": 0}
              for i in range(6)]
    first = server.stats()["replicas"]
    responses = complete_all(server, bodies)
    assert all(r is not None and r.status_code == 200 for r in responses)
    last = server.stats()["replicas"]
    counts = [b["num_requests_routed"] - a["num_requests_routed"] for a, b in zip(first, last)]
    assert sorted(counts) == [0, 6], counts
    owner = counts.index(6)
    cached = last[owner]["cached_prompt_tokens"] - first[owner]["cached_prompt_tokens"]
    assert cached >= 16  # at least one request found the shared block in the cache


def test_killed_replica_fails_its_requests_and_the_other_serves(server):
    prefix = list(range(4000, 4017))  # both requests share a block: they go to one replica
    long = {"max_tokens": 1000, "ignore_eos": True, "n": 4}
    whole = [None]

    def ask_whole():
        with server.client(timeout=60) as c:
            whole[0] = c.post("/v1/completions", json={"prompt": prefix + [1], **long})
    asker = threading.Thread(target=ask_whole)
    asker.start()
    stream_body = {"prompt": prefix + [2], **long, "stream": True}
    with server.client(timeout=60) as c, c.stream("POST", "/v1/completions",
                                                   json=stream_body) as r:
        end = time.monotonic() + 20
        while not (busy := [e for e in server.stats()["replicas"] if e["num_running"]]) or \
                busy[0]["num_running"] < 8:  # both requests' 4 samples run, on one replica
            assert time.monotonic() < end and whole[0] is None, busy
            time.sleep(0.02)
        (victim,) = busy
        os.kill(victim["pid"], signal.SIGKILL)
        rest = list(r.iter_lines())
    events = [line for line in rest if line.startswith("data: ")]
    assert '"error"' in events[-1] and "died" in events[-1]  # an error event ends the stream
    assert "data: [DONE]" not in events
    asker.join(60)
    assert whole[0].status_code in (500, 503) and "died" in whole[0].text
    with server.client() as c:
        health = c.get("/health")
        assert health.status_code == 503
        assert f"replica {victim['replica']} (pid {victim['pid']})" in health.text
        for i in range(4):  # new requests, even with the dead replica's prefix, are served
            r = c.post("/v1/completions", json={"prompt": prefix + [i], "max_tokens": 4})
            assert r.status_code == 200, r.text
    stats = server.stats()
    dead, alive = sorted(stats["replicas"], key=lambda e: e["alive"])
    assert dead["replica"] == victim["replica"] and not dead["alive"] and alive["alive"]
    assert stats["num_running"] == 0 and stats["kv_blocks_total"] == alive["kv_blocks_total"]


def test_sigterm_stops_the_server_and_every_replica(server):
    pids = [e["pid"] for e in server.stats()["replicas"] if e["alive"]]
    assert pids
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(30) == 0
    end = time.monotonic() + 15
    while any(os.path.exists(f"/proc/{pid}") and not zombie(pid) for pid in pids):
        assert time.monotonic() < end, "a replica outlived its server"
        time.sleep(0.1)
    assert any("nanovllm: stopped" in line for line in server.log)


def zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_waiting_limit_counts_over_replicas_and_sigterm_aborts_all(random_smol, smollm2_dir):
    """--max-waiting-requests bounds the requests waiting on all replicas together (each runs 2);
    with no grace period, SIGTERM aborts the streams of every replica ("abort", then [DONE])."""
    srv = Server(random_smol, *SMALL_ENGINE[:-2], "--max-num-seqs", "2", "--tokenizer",
                 smollm2_dir, "--max-waiting-requests", "4", "--grace-period", "0",
                 "--data-parallel-size", "2")
    try:
        peak, done = [0], threading.Event()

        def watch():
            while not done.is_set():
                peak[0] = max(peak[0], srv.stats()["num_waiting"])
        watcher = threading.Thread(target=watch)
        watcher.start()
        body = {"prompt": "Once upon a time", "max_tokens": 64, "temperature": 0,
                "ignore_eos": True}
        results = complete_all(srv, [body] * 40)
        done.set()
        watcher.join(30)
        refused = [r for r in results if r.status_code == 503]
        served = [r for r in results if r.status_code == 200]
        assert len(refused) + len(served) == 40 and refused and served
        assert all("--max-waiting-requests" in r.text for r in refused)
        assert all(r.json()["usage"]["completion_tokens"] == 64 for r in served)
        assert 0 < peak[0] <= 4  # one limit for both replicas, not 4 each
        events = {}

        def stream(i):
            body = {"prompt": [5000 + i], "max_tokens": 1000, "ignore_eos": True, "stream": True}
            with srv.client(timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as r:
                events[i] = sse_events(r)
        streams = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        for t in streams:
            t.start()
        end = time.monotonic() + 20
        while [e["num_running"] for e in srv.stats()["replicas"]] != [1, 1]:
            assert time.monotonic() < end
            time.sleep(0.02)
        srv.proc.send_signal(signal.SIGTERM)
        for t in streams:
            t.join(30)
        assert srv.proc.wait(30) == 0
    finally:
        srv.kill()
    finish = [[c["finish_reason"] for e in events[i] for c in e["choices"]][-1] for i in range(2)]
    assert finish == ["abort", "abort"]


def test_router_keeps_a_prefix_on_its_replica_until_it_is_much_busier():
    from nanovllm.serve.replicas import BALANCE_SLACK, Router, prefix_key
    router, routed = Router(block_size=4), {0: 0, 1: 0}
    shared = [7, 7, 7, 7]
    assert router.choose(shared + [1], {0: 0, 1: 0}, routed) == 0  # least loaded: a tie, 0
    assert router.choose(shared + [2], {0: 5, 1: 0}, routed) == 0  # its prefix: busier, kept
    assert router.choose([7, 7, 7], {0: 5, 1: 0}, routed) == 1  # no full block: least loaded
    assert router.choose(shared, {0: BALANCE_SLACK + 1, 1: 0}, routed) == 1  # far busier: moved
    assert router.choose(shared + [3], {0: 0, 1: 0}, routed) == 1  # and remembered there
    assert router.choose([1, 2, 3, 4], {0: 0, 1: 0}, {0: 3, 1: 2}) == 1  # tie: fewer taken so far
    assert router.choose(shared, {0: 0}, routed) == 0  # its replica out of service
    assert prefix_key([1, 2, 3], 4) is None and prefix_key([1, 2, 3, 4, 5], 4) == \
        prefix_key([1, 2, 3, 4, 6], 4)


def test_least_loaded_routing_spreads_a_shared_prefix_that_prefix_routing_keeps():
    from nanovllm.serve.replicas import Router
    shared = [7, 7, 7, 7]
    for routing, expected in (("prefix", [0, 0, 0, 0]), ("least-loaded", [0, 1, 0, 1])):
        router, loads, routed = Router(block_size=4, routing=routing), {0: 0, 1: 0}, {0: 0, 1: 0}
        chosen = []
        for i in range(4):  # sent at once: each still holds the requests it took
            chosen.append(router.choose(shared + [i], loads, routed))
            loads[chosen[-1]] += 1
            routed[chosen[-1]] += 1
        assert chosen == expected, routing


def test_a_routing_that_does_not_exist_is_refused(capsys):
    from nanovllm.serve.cli import build_parser
    from nanovllm.serve.replicas import Router
    with pytest.raises(ValueError, match="routing='random': use one of prefix, least-loaded"):
        Router(block_size=16, routing="random")
    assert build_parser().parse_args(["m"]).routing == "prefix"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["m", "--routing", "random"])
    assert "--routing: invalid choice: 'random'" in capsys.readouterr().err


def test_least_loaded_server_spreads_a_shared_prefix(random_smol, smollm2_dir):
    """`--routing least-loaded` reaches the router: requests sharing a first block, sent at once,
    land on both replicas (test_shared_prefix_goes_to_one_replica: one, by default)."""
    srv = Server(random_smol, *SMALL_ENGINE, "--tokenizer", smollm2_dir,
                 "--data-parallel-size", "2", "--routing", "least-loaded")
    try:
        prefix = list(range(2000, 2020))
        bodies = [{"prompt": prefix + [3000 + i], "max_tokens": 32, "temperature": 0,
                   "ignore_eos": True} for i in range(6)]
        responses = complete_all(srv, bodies)
        assert all(r is not None and r.status_code == 200 for r in responses)
        counts = routed(srv)
    finally:
        srv.kill()
    assert sum(counts) == 6 and min(counts) >= 1, counts


def test_a_replica_sends_its_outputs_without_their_prompts(random_smol):
    """A step's outputs cross the pipe without the prompt (the server holds it and puts it back):
    what a replica sends per token does not grow with the prompt's length."""
    import multiprocessing as mp
    import pickle

    from nanovllm import SamplingParams
    from nanovllm.serve.replicas import serve_commands
    llm = make_llm(random_smol, **ENGINE)
    commands_out, commands_in = mp.Pipe(duplex=False)
    results_out, results_in = mp.Pipe(duplex=False)
    thread = threading.Thread(target=serve_commands, args=(llm, commands_out, results_in))
    thread.start()
    sizes, finished = {}, set()
    try:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        prompts = [("short", list(range(1000, 1020))), ("long", list(range(1000, 1900)))]
        commands_in.send(("add", 0, [rid for rid, _ in prompts],
                          [(ids, None) for _, ids in prompts], params))
        while len(finished) < 2:
            data = results_out.recv_bytes()
            kind, outputs, _, _ = pickle.loads(data)
            if kind == "outputs":
                for out in outputs:
                    sizes.setdefault(out.request_id, []).append(len(pickle.dumps(out)))
                    if out.finished:
                        finished.add(out.request_id)
    finally:
        commands_in.send(("stop",))
        thread.join(60)
        llm.shutdown()
    assert len(sizes["long"]) >= 6
    assert max(sizes["long"]) < min(sizes["short"]) + 100, sizes  # 900 ids would be 2,700 bytes


def test_each_replica_sees_its_own_gpus():
    from nanovllm.serve.replicas import replica_devices
    visible = ["0", "1", "2", "3", "4", "5"]
    assert [replica_devices(i, 1, visible) for i in range(3)] == ["0", "1", "2"]
    assert [replica_devices(i, 2, visible) for i in range(3)] == ["0,1", "2,3", "4,5"]


def test_a_replica_freezes_its_engine_before_it_serves(random_smol, monkeypatch):
    """A replica's engine is out of the collector's reach once it reports ready (a full collection
    would walk all its objects: a stall of every request it holds), as the one-engine server's."""
    import gc
    import multiprocessing as mp

    from nanovllm.serve import replicas
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # keep pytest's own handlers
    commands_out, commands_in = mp.Pipe(duplex=False)
    results_out, results_in = mp.Pipe(duplex=False)
    seen = {}
    serve_commands = replicas.serve_commands

    def serving(llm, commands, results):  # what holds when the replica starts serving
        model = llm.model_runner.model
        seen["model collectable"] = any(obj is model for obj in gc.get_objects())
        serve_commands(llm, commands, results)
    monkeypatch.setattr(replicas, "serve_commands", serving)
    commands_in.send(("stop",))
    try:
        replicas.run_replica(random_smol, {**ENGINE, "skip_tokenizer_init": True}, commands_out,
                             results_in, None)
        seen["frozen"] = gc.get_freeze_count()
    finally:
        gc.unfreeze()
    assert results_out.recv()[0] == "ready"
    assert seen["model collectable"] is False and seen["frozen"] > 10_000, seen
