"""The server under attack and when it stops: a property-based fuzz of request bodies
(never a 500, and the same greedy text afterwards), a flood past the waiting limit (503 with
Retry-After, then served again; never more waiting than the limit), and SIGTERM with streams and
a whole answer in flight (the short stream finishes, the long ones end with "abort" and [DONE],
the whole answer gets 503, new calls get 503, exit status 0, every KV block free) or with clients
that stall (the server still ends within its grace period and a second). One request never hurts
another: huge prompts are refused without stalling a stream, a value past its bounds is a 400
that fails no other request."""
import contextlib
import json
import signal
import socket
import threading
import time

import httpx
import pytest

from tests.serve_helpers import SMALL_ENGINE, Server, sse_events

pytestmark = pytest.mark.slow  # the quick subset, -m "not slow", leaves it out

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

GREEDY = {"prompt": "The quick brown fox", "temperature": 0, "max_tokens": 16, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(random_smol, smollm2_dir):
    srv = Server(random_smol, *SMALL_ENGINE, "--tokenizer", smollm2_dir,
                 "--max-body-bytes", "65536", "--served-model-name", "random_smol")
    yield srv
    srv.kill()


JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                      st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20))
JSON = st.recursive(JSON_LEAF, lambda inner: st.lists(inner, max_size=4) |
                    st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
TOKENS = st.lists(st.integers(0, 49151), min_size=1, max_size=8)
VALID = {  # field: values a client may send
    "prompt": st.one_of(st.text(min_size=1, max_size=40), TOKENS),
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]),
                                                "content": st.text(max_size=30)}),
                         min_size=1, max_size=2),
    "max_tokens": st.integers(1, 8),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50),
    "n": st.integers(1, 3),
    "stop": st.one_of(st.text(min_size=1, max_size=3),
                      st.lists(st.text(min_size=1, max_size=3), max_size=3)),
    "seed": st.integers(0, 2**32),
    "logprobs": st.one_of(st.integers(0, 5), st.booleans()),
    "top_logprobs": st.integers(0, 5),
    "presence_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "min_tokens": st.integers(0, 4),
    "stop_token_ids": st.lists(st.integers(0, 49151), max_size=3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "model": st.just("random_smol"),
    "ignore_eos": st.booleans(),
}
HOSTILE = {  # values past the edges, of the wrong type, or anything at all
    "prompt": st.one_of(st.lists(st.integers(-3, 60000), max_size=8), JSON),
    "messages": st.one_of(st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "bot"]), "content": JSON}), max_size=3), JSON),
    "max_tokens": st.one_of(st.integers(-2, 0), st.integers(10**4, 10**12),
                            JSON_LEAF.filter(lambda v: v is not None)),
    "n": st.one_of(st.integers(-1, 0), st.integers(60, 200), JSON_LEAF),
    "seed": st.one_of(st.integers(-2**65, 2**65), JSON_LEAF),
    "model": st.one_of(st.text(max_size=10), JSON_LEAF),
}
REQUIRED = {"/v1/completions": "prompt", "/v1/chat/completions": "messages"}


@st.composite
def bodies(draw):
    """(path, body bytes): bodies a client may send with some fields off, some unknown fields,
    some truncated JSON and some raw bytes."""
    path = draw(st.sampled_from(sorted(REQUIRED)))
    fields = [f for f in VALID if f not in REQUIRED.values()]
    names = [REQUIRED[path], *draw(st.lists(st.sampled_from(fields), max_size=6, unique=True))]
    body = {"max_tokens": draw(VALID["max_tokens"])}  # a short default: the fuzz stays fast
    for name in names:
        hostile = draw(st.integers(0, 9)) == 0
        body[name] = draw(HOSTILE.get(name, JSON) if hostile else VALID[name])
    if draw(st.integers(0, 9)) == 0:
        body.update(draw(st.dictionaries(st.text(max_size=12), JSON, min_size=1, max_size=2)))
    text = json.dumps(body).encode()
    how = draw(st.sampled_from(["json"] * 18 + ["truncated", "bytes"]))
    if how == "truncated":
        text = text[:draw(st.integers(0, len(text)))]
    elif how == "bytes":
        text = draw(st.binary(max_size=200))
    return path, text


def greedy_text(srv: Server) -> str:
    with srv.client() as c:
        r = c.post("/v1/completions", json=GREEDY)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]


def test_fuzzed_bodies_never_500(server):
    before = greedy_text(server)
    statuses = {}
    with server.client(timeout=120) as c:
        @hypothesis.settings(max_examples=500, deadline=None, derandomize=True, database=None,
                             suppress_health_check=list(hypothesis.HealthCheck))
        @hypothesis.given(bodies())
        def send(case):
            path, body = case
            with c.stream("POST", path, content=body,
                          headers={"Content-Type": "application/json"}) as r:
                r.read()  # the whole answer, or the whole stream
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                assert r.status_code in (200, 400, 404), r.text
                if r.status_code != 200:
                    assert "error" in r.json()
                elif r.headers["content-type"].startswith("text/event-stream"):
                    assert r.text.endswith("data: [DONE]\n\n")
        send()
    assert sum(statuses.values()) >= 500 and statuses[200] >= 100 and statuses[400] >= 100
    stats = server.wait_drained()
    assert stats["num_running"] == stats["kv_blocks_used"] == 0
    assert greedy_text(server) == before  # the engine serves on, unchanged


def test_flood_past_waiting_limit(random_smol, smollm2_dir):
    srv = Server(random_smol, *SMALL_ENGINE[:-2], "--max-num-seqs", "2", "--tokenizer",
                 smollm2_dir, "--max-waiting-requests", "4")
    try:
        results = [None] * 40

        def ask(i):
            with srv.client() as c:
                results[i] = c.post("/v1/completions", json={**GREEDY, "max_tokens": 64})
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(40)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        refused = [r for r in results if r.status_code == 503]
        served = [r for r in results if r.status_code == 200]
        assert len(refused) + len(served) == 40 and refused and served
        assert all(r.headers["retry-after"] == "1" and "--max-waiting-requests" in r.text
                   for r in refused)
        assert all(r.json()["usage"]["completion_tokens"] == 64 for r in served)  # none lost
        srv.wait_drained()
        with srv.client() as c:
            assert c.post("/v1/completions", json=GREEDY).status_code == 200  # served again
    finally:
        srv.kill()


def test_sigterm_finishes_or_aborts_then_exits_0(smollm2_dir):
    srv = Server(smollm2_dir, *SMALL_ENGINE, "--grace-period", "8")
    long = {"prompt": "Count to a thousand:", "max_tokens": 900, "ignore_eos": True}
    events, whole = {}, {}

    def stream(name, body):
        with srv.client() as c, c.stream("POST", "/v1/completions",
                                         json={**body, "stream": True}) as r:
            events[name] = sse_events(r)

    def answer():
        with srv.client() as c:
            whole["response"] = c.post("/v1/completions", json=long)
    short = {"prompt": "Hi", "max_tokens": 8, "ignore_eos": True}
    threads = [threading.Thread(target=stream, args=("short", short)),
               threading.Thread(target=stream, args=("long1", long)),
               threading.Thread(target=stream, args=("long2", long)),
               threading.Thread(target=answer)]
    try:
        for t in threads:
            t.start()
        end = time.monotonic() + 120
        while srv.stats()["num_running"] < 4 and time.monotonic() < end:
            time.sleep(0.02)
        srv.proc.send_signal(signal.SIGTERM)
        with httpx.Client(base_url=srv.url, headers=srv.headers, trust_env=False) as c:
            late = c.post("/v1/completions", json=GREEDY)
        for t in threads:
            t.join(timeout=120)
        assert srv.proc.wait(timeout=60) == 0
    finally:
        srv.kill()
    assert late.status_code == 503 and late.json()["error"]["type"] == "service_unavailable"
    finish = {name: [c["finish_reason"] for e in ev for c in e["choices"]][-1]
              for name, ev in events.items()}
    assert finish == {"short": "length", "long1": "abort", "long2": "abort"}
    assert whole["response"].status_code == 503
    figures = json.loads("".join(srv.log).split("engine figures: ")[1].splitlines()[0])
    assert figures["kv_blocks_used"] == figures["num_running"] == figures["num_waiting"] == 0


def stream_gaps(srv: Server, started: threading.Event, stop: threading.Event) -> list[float]:
    """Arrival times of a long greedy stream's events, until `stop` is set (then it hangs up)."""
    times = []
    body = {**GREEDY, "max_tokens": 3000, "stream": True}
    with srv.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                times.append(time.monotonic())
                if len(times) == 5:
                    started.set()
            if stop.is_set() or line == "data: [DONE]":
                break
    started.set()
    return times


def test_refused_huge_prompts_do_not_stall_a_stream(random_smol, smollm2_dir):
    """Ten prompts of 2 MiB each, refused (far longer than max_model_len tokens), beside a stream:
    refusing them costs the stream no step (no tokenizing on the engine thread)."""
    srv = Server(random_smol, *SMALL_ENGINE, "--max-model-len", "4096", "--tokenizer",
                 smollm2_dir, "--max-body-bytes", str(3 << 20))
    try:
        started, stop, result = threading.Event(), threading.Event(), {}
        reader = threading.Thread(target=lambda: result.update(
            times=stream_gaps(srv, started, stop)))
        reader.start()
        assert started.wait(120)
        huge = ("the quick brown fox jumps over the lazy dog " * 50_000)[:2 << 20]
        body = json.dumps({"prompt": huge, "max_tokens": 1}).encode()
        statuses = [None] * 10

        def refuse(i):
            with srv.client() as c:
                statuses[i] = c.post("/v1/completions", content=body,
                                     headers={"Content-Type": "application/json"})
        begin = time.monotonic()
        threads = [threading.Thread(target=refuse, args=(i,)) for i in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        end = time.monotonic()
        time.sleep(0.3)
        stop.set()
        reader.join(120)
    finally:
        srv.kill()
    assert all(r.status_code == 400 and r.json()["error"]["param"] == "prompt" for r in statuses)
    times = [t for t in result["times"] if begin - 1 <= t]
    assert times and times[-1] > end, "the stream ended before the refusals did"
    gaps = [b - a for a, b in zip(times, times[1:])]
    print(f"largest gap between stream events: {max(gaps):.3f} s over {len(gaps)} gaps")
    assert max(gaps) < 0.5


def test_a_request_past_the_bounds_is_400_and_fails_no_other(server):
    """top_k=2**63 is a 400: accepted, beside a request with top_k=5 it would overflow the step's
    top_k tensor, and both would get 500 (a stream: an error event without [DONE])."""
    events = {}

    def stream():
        body = {"prompt": "Once upon a time", "temperature": 1, "top_k": 5, "max_tokens": 200,
                "ignore_eos": True, "stream": True}
        with server.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
            events["stream"] = sse_events(r)
    reader = threading.Thread(target=stream)
    reader.start()
    with server.client() as c:
        for _ in range(5):
            r = c.post("/v1/completions", json={"prompt": "a", "temperature": 1, "top_k": 2**63})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "top_k" and "49152" in error["message"]
    reader.join(120)
    assert events["stream"][-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len(e["choices"][0]["text"]) > 0 for e in events["stream"]) > 0


def test_a_model_of_the_wrong_type_is_400_naming_it(server):
    """"model": 5 is a 400 naming the field, not a 404 "the model '5' does not exist"."""
    with server.client() as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "model": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    assert "'model' must be a string" in r.json()["error"]["message"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 1}', "prompt"),
    ("/v1/completions", b'{"prompt": "a", "stop": ["\\udfff"]}', "stop"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
     "messages"),
    ("/v1/completions", b'{"prompt": "a", "\\ud800": 1}', None),
], ids=["prompt", "stop", "message", "field-name"])
def test_lone_surrogates_are_400_naming_the_field(server, path, body, param):
    """JSON's "\\ud800" escape gives a string that is not Unicode text: a 400 naming the field
    (not the tokenizer's own message with param null, nor a 500 for a field's name echoed in the
    error)."""
    with server.client() as c:
        r = c.post(path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert "lone surrogate" in r.json()["error"]["message"]


def test_the_bearer_scheme_in_any_case(server):
    """RFC 9110: an auth scheme is case-insensitive: "bearer KEY" and "BEARER KEY" pass."""
    body = {"prompt": "hi", "max_tokens": 1}
    with httpx.Client(base_url=server.url, trust_env=False) as c:
        for scheme in ("bearer", "BEARER", "Bearer"):
            r = c.post("/v1/completions", json=body,
                       headers={"Authorization": f"{scheme} {server.api_key}"})
            assert r.status_code == 200, (scheme, r.text)
        for header in (f"Basic {server.api_key}", f"bearer{server.api_key}", "bearer nope",
                       f"bearer {server.api_key}x"):
            r = c.post("/v1/completions", json=body, headers={"Authorization": header})
            assert r.status_code == 401, header


def test_waiting_limit_is_never_passed(smollm2_dir):
    """Requests opened one after another while one runs (max_num_seqs=1): exactly
    --max-waiting-requests of them wait, the next gets 503. A request just queued counts as
    waiting at once, not only after the engine's next step (else a fifth would wait)."""
    srv = Server(smollm2_dir, *SMALL_ENGINE[:-2], "--max-num-seqs", "1",
                 "--max-waiting-requests", "4")
    long = {"prompt": "Count to a thousand:", "max_tokens": 900, "ignore_eos": True,
            "stream": True}
    try:
        with contextlib.ExitStack() as stack:
            c = stack.enter_context(srv.client(limits=httpx.Limits(max_connections=20)))
            first = stack.enter_context(c.stream("POST", "/v1/completions", json=long))
            lines = first.iter_lines()  # (a generator collected would hang up)
            next(lines)  # it runs
            statuses = []
            for _ in range(6):
                r = stack.enter_context(c.stream("POST", "/v1/completions", json=long))
                statuses.append(r.status_code)
            stats = srv.stats()
        assert statuses == [200] * 4 + [503] * 2, statuses
        assert stats["num_waiting"] == 4 and stats["num_running"] == 1
        srv.wait_drained()
    finally:
        srv.kill()


def test_stopping_ends_within_the_grace_period_whatever_the_clients_do(random_smol, smollm2_dir):
    """One client sends its headers and half its body, one streams and never reads, one waits
    for a whole answer: SIGTERM with a 2 s grace period ends the server within 3 s, with status
    0 and no traceback: it waits neither for calls to finish after the aborts nor for uvicorn's
    own graceful shutdown, which would cancel the handlers (a CancelledError traceback)."""
    grace = 2.0
    srv = Server(random_smol, *SMALL_ENGINE, "--max-model-len", "4096", "--tokenizer",
                 smollm2_dir, "--grace-period", str(grace), api_key=None)
    host, port = srv.url.removeprefix("http://").split(":")
    sockets = []
    try:
        half = socket.create_connection((host, int(port)))
        half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 1000\r\n\r\n" + b" " * 500)
        deaf = socket.socket()
        deaf.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        deaf.connect((host, int(port)))
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 4000, "n": 8,
                           "logprobs": 20, "ignore_eos": True, "stream": True}).encode()
        deaf.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        sockets += [half, deaf]
        whole = threading.Thread(target=lambda: srv.client().post(
            "/v1/completions", json={"prompt": "Hi", "max_tokens": 4000, "ignore_eos": True}))
        whole.start()
        end = time.monotonic() + 60
        while srv.stats()["num_running"] < 9 and time.monotonic() < end:
            time.sleep(0.05)
        time.sleep(1)
        start = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        status = srv.proc.wait(timeout=60)
        took = time.monotonic() - start
        whole.join(60)
    finally:
        for s in sockets:
            s.close()
        srv.kill()
    log = "".join(srv.log)
    print(f"stopped {took:.2f} s after SIGTERM (grace period {grace} s)")
    assert status == 0 and took < grace + 1, (took, log[-3000:])
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
