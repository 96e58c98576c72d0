"""The OpenAI-compatible server (nanovllm/serve/) against a live process on 127.0.0.1, through the
official `openai` client and raw HTTP (httpx): completions and chat, streamed and not, several
prompts and samples, log-probabilities, stop strings, the error cases, the key, body limits,
concurrent clients in shared steps, aborts on disconnect, an idle server at rest; and unit tests
of the command line and the merging of queued outputs."""
import os
import threading
import time

import httpx
import pytest

from tests.helpers import FRANCE, FRANCE_ANSWER
from tests.serve_helpers import KEY, SMALL_ENGINE, Server, sse_events

pytestmark = pytest.mark.slow  # the quick subset, -m "not slow", leaves it out

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server(smollm2_dir):
    srv = Server(smollm2_dir, *SMALL_ENGINE, "--max-body-bytes", "65536")
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


@pytest.fixture(scope="module")
def http(server):
    with server.client() as c:
        yield c


def test_models_and_health(server, http):
    assert http.get("/v1/models").json()["data"][0]["id"] == "SmolLM2-135M-Instruct"
    with httpx.Client(base_url=server.url, trust_env=False) as anonymous:
        assert anonymous.get("/health").json() == {"status": "ok"}  # open without the key


def test_completion_stream_adds_up_to_whole(client):
    args = {"model": "SmolLM2-135M-Instruct", "prompt": "The three primary colors are",
            "temperature": 0, "max_tokens": 24}
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text and len(text) > 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == \
        whole.choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_whole_and_streamed(client):
    messages = [{"role": "user", "content": FRANCE}]
    whole = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                           temperature=0, max_tokens=32)
    assert whole.choices[0].message.content == FRANCE_ANSWER
    assert whole.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                                 temperature=0, max_tokens=32, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == FRANCE_ANSWER


def test_prompts_and_samples_seeded(client):
    args = {"model": "SmolLM2-135M-Instruct", "prompt": ["Once upon a time", "My favorite food is"],
            "n": 3, "seed": 7, "temperature": 1.0, "max_tokens": 12,
            "extra_body": {"ignore_eos": True}}
    first = client.completions.create(**args)
    again = client.completions.create(**args)
    assert sorted(c.index for c in first.choices) == list(range(6))
    assert [c.text for c in first.choices] == [c.text for c in again.choices]  # the seed
    assert len({c.text for c in first.choices}) > 1  # samples differ
    assert first.usage.completion_tokens == 6 * 12


def test_streamed_prompts_and_samples_add_up(http):
    body = {"prompt": ["Once upon a time", "My favorite food is"], "n": 2, "seed": 3,
            "max_tokens": 10, "ignore_eos": True}
    whole = http.post("/v1/completions", json=body).json()
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=streamed) as r:
        events = sse_events(r)
    texts, ends = ["" for _ in range(4)], {}
    for event in events[:-1]:
        (choice,) = event["choices"]
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"]:
            ends[choice["index"]] = choice["finish_reason"]
    assert texts == [c["text"] for c in sorted(whole["choices"], key=lambda c: c["index"])]
    assert ends == dict.fromkeys(range(4), "length")
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]


def test_logprobs(client):
    out = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Paris is the capital of",
                                    temperature=0, max_tokens=5, logprobs=3)
    lp = out.choices[0].logprobs
    assert "".join(lp.tokens) == out.choices[0].text and len(lp.token_logprobs) == 5
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and max(top.values()) == pytest.approx(chosen)  # greedy: the top one
    chat = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=4,
                                          messages=[{"role": "user", "content": FRANCE}],
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob)


def test_stop_string(client):
    args = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": FRANCE}],
            "temperature": 0, "max_tokens": 32}
    out = client.chat.completions.create(**args, stop=["Paris"])
    assert out.choices[0].message.content == FRANCE_ANSWER[:FRANCE_ANSWER.find("Paris")]
    assert out.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(**args, stop=["Paris"], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == \
        out.choices[0].message.content


ERRORS = [  # (body, the field the 400 names)
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "n": True}, "n"),
    ({"prompt": "hi", "stop": [""]}, "stop"),
    ({"prompt": "hi", "stop": 3}, "stop"),
    ({"prompt": "hi", "seed": "x"}, "seed"),
    ({"prompt": "hi", "logprobs": 99}, "logprobs"),
    ({"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "hi", "frequency_penalty": -2.5}, "frequency_penalty"),
    ({"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "hi", "top_k": -2}, "top_k"),
    ({"prompt": "hi", "min_p": 2}, "min_p"),
    ({"prompt": "hi", "stream": "yes"}, "stream"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "hi", "echo": True}, "echo"),
    ({"prompt": "hi", "best_of": 3}, "best_of"),
    ({"prompt": "hi", "temprature": 0}, "temprature"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": {"text": "hi"}}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "hi", "min_tokens": 9, "max_tokens": 4}, "min_tokens"),
]
CHAT_ERRORS = [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "hi", "extra": 1}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": 2}, "logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools"),
]


@pytest.mark.parametrize("path, body, param", [("/v1/completions", *e) for e in ERRORS] +
                         [("/v1/chat/completions", *e) for e in CHAT_ERRORS])
def test_bad_fields_are_400_naming_them(http, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert param.split("[")[0] in error["message"]


def test_requests_that_cannot_fit_are_400_with_numbers(http):
    r = http.post("/v1/completions", json={"prompt": [5] * 1100, "max_tokens": 4})
    assert r.status_code == 400 and "1100" in r.text and "1024" in r.text
    assert r.json()["error"]["param"] == "prompt"
    r = http.post("/v1/completions", json={"prompt": [5] * 8, "max_tokens": 1000, "n": 40})
    assert r.status_code == 400 and "512" in r.text  # more KV blocks than the whole cache
    assert r.json()["error"]["param"] == "max_tokens"
    r = http.post("/v1/completions", json={"prompt": [5] * 8, "max_tokens": 4, "n": 100})
    assert r.status_code == 400 and "max_num_seqs=64" in r.text
    assert r.json()["error"]["param"] == "n"
    r = http.post("/v1/completions", json={"prompt": [49152, 3], "max_tokens": 4})
    assert r.status_code == 400 and "49152" in r.text  # outside the vocabulary
    r = http.post("/v1/completions", json={"prompt": "hi", "model": "gpt-4"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert http.get("/v1/nothing").status_code == 404


@pytest.mark.parametrize("body", [b"{", b'{"prompt": "hi", "temperature": NaN}',
                                  b'{"prompt": "hi", "temperature": 1e999}', b"[" * 60_000,
                                  b'{"prompt": "\xff"}', b'"just a string"', b""],
                         ids=["truncated", "nan", "inf", "deep", "utf8", "string", "empty"])
def test_malformed_bodies_are_400(http, body):
    r = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()


def test_api_key(server):
    with httpx.Client(base_url=server.url, trust_env=False) as c:
        body = {"prompt": "hi", "max_tokens": 1}
        assert c.post("/v1/completions", json=body).status_code == 401
        wrong = c.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
        right = c.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert right.status_code == 200
    with pytest.raises(openai.AuthenticationError):
        server.openai(api_key="nope").models.list()


def test_oversized_bodies_are_413(http):
    big = {"prompt": "x" * 70_000}
    assert http.post("/v1/completions", json=big).status_code == 413  # declares its length

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(20):
            yield b" " * 4096
    r = http.post("/v1/completions", content=chunks())
    assert r.status_code == 413 and "65536" in r.json()["error"]["message"]


def test_concurrent_clients_share_steps(server, client):
    peak, done = [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], server.stats()["num_running"])
            time.sleep(0.05)
    texts = [None] * 16

    def ask(i):
        out = client.completions.create(model="SmolLM2-135M-Instruct", prompt=f"Story {i}:",
                                        temperature=0, max_tokens=16,
                                        extra_body={"ignore_eos": True})
        texts[i] = out.choices[0].text
    watcher = threading.Thread(target=watch)
    watcher.start()
    clients = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
    for t in clients:
        t.start()
    for t in clients:
        t.join()
    done.set()
    watcher.join()
    assert all(texts) and peak[0] >= 8  # continuous batching across HTTP clients


def test_disconnect_mid_stream_aborts_and_frees(server):
    body = {"prompt": "Count:", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with server.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        for _ in range(8):  # four events (each ends with an empty line)
            next(lines)
        assert server.stats()["num_running"] == 1
    # leaving the block (or dropping `lines`) closes the connection mid-stream
    stats = server.wait_drained()
    assert stats["num_running"] == 0 and stats["kv_blocks_used"] == 0


def test_whole_answer_client_timeout_aborts(server):
    with server.client(timeout=1.0) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/v1/completions", json={"prompt": "Count:", "max_tokens": 900, "ignore_eos": True})
    stats = server.wait_drained()
    assert stats["num_running"] == 0 and stats["kv_blocks_used"] == 0


def test_idle_server_does_not_spin(server):
    server.wait_drained()

    def cpu_seconds():
        with open(f"/proc/{server.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    before = cpu_seconds()
    time.sleep(2)
    assert cpu_seconds() - before < 0.1


def test_engine_flags_come_from_config():
    from nanovllm.serve.cli import build_parser, engine_options
    args = build_parser().parse_args(["m", "--attn-backend", "triton", "--no-enable-prefix-caching",
                                      "--max-num-seqs", "8", "--tokenizer", "t", "--port", "0"])
    assert engine_options(args) == {"attn_backend": "triton", "enable_prefix_caching": False,
                                    "max_num_seqs": 8, "tokenizer": "t"}
    assert "new tokens per step" in build_parser().format_help()  # Config's comments as help
    with pytest.raises(SystemExit):
        build_parser().parse_args(["m", "--attn-backend", "nope"])


def test_engine_choices_made_for_you_are_auto():
    """Config's "" (the engine chooses) is "auto" on the command line: --help shows no empty
    choice such as {,flash,triton,sdpa}."""
    from nanovllm.serve.cli import build_parser, engine_options
    help = build_parser().format_help()
    assert "--attn-backend {auto,flash,triton,sdpa}" in help and "{auto,cuda,cpu}" in help
    assert "{," not in help
    args = build_parser().parse_args(["m", "--attn-backend", "auto", "--device", "auto"])
    assert engine_options(args) == {"attn_backend": "", "device": ""}
    args = build_parser().parse_args(["m", "--dtype", "auto", "--attn-backend", "sdpa"])
    assert engine_options(args) == {"dtype": "auto", "attn_backend": "sdpa"}


def test_console_command():
    from nanovllm.cli import main
    assert main([]) == 2 and main(["generate"]) == 2
    with pytest.raises(SystemExit) as exit:
        main(["serve", "--help"])
    assert exit.value.code == 0


def test_no_key_warning():
    from nanovllm.serve.cli import exposed_without_key
    assert exposed_without_key("0.0.0.0", None) and exposed_without_key("::", "")
    assert not exposed_without_key("0.0.0.0", "k") and not exposed_without_key("127.0.0.1", None)
    assert not exposed_without_key("localhost", None) and not exposed_without_key("::1", None)


def test_merge_of_queued_outputs():
    from nanovllm.outputs import CompletionOutput, RequestOutput
    from nanovllm.serve.engine_thread import merge

    def out(text, ids, finish=None):
        return RequestOutput("r", None, [1], [CompletionOutput(0, text, ids, None, [{i: -1.0}
                                                                                    for i in ids],
                                                               finish)], finish is not None, 0)
    merged = merge(merge(out("a", [1]), out("bc", [2, 3])), out("", [], "stop"))
    sample = merged.outputs[0]
    assert (sample.text, sample.token_ids, len(sample.logprobs)) == ("abc", [1, 2, 3], 3)
    assert sample.finish_reason == "stop" and merged.finished


def test_engine_thread_survives_a_failed_step(tiny_path):
    """A step that raises ends the requests the engine held (with the error), and the engine
    thread serves the next request as if nothing happened."""
    import asyncio

    from nanovllm import SamplingParams
    from nanovllm.serve.engine_thread import EngineFailure, EngineThread
    from tests.helpers import make_llm
    llm = make_llm(tiny_path)
    params = SamplingParams(temperature=0, max_tokens=8, output_kind="final")
    expected = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0].token_ids
    real_step = llm.step

    def failing_step():
        llm.step = real_step  # once
        raise RuntimeError("boom")

    async def scenario():
        engine = EngineThread(llm, asyncio.get_running_loop())
        engine.start()
        try:
            llm.step, queue = failing_step, asyncio.Queue()
            await engine.add(["a", "b"], [[1, 2, 3], [4, 5]], params, queue)
            failures = [await queue.get(), await queue.get()]
            queue = asyncio.Queue()
            await engine.add(["c"], [[1, 2, 3]], params, queue)
            return failures, await queue.get(), await engine.call(llm.get_stats)
        finally:
            engine.stop()
    failures, out, stats = asyncio.run(scenario())
    assert all(isinstance(f, EngineFailure) and "boom" in str(f) for f in failures)
    assert out.finished and out.outputs[0].token_ids == expected
    assert stats["num_running"] == stats["kv_blocks_used"] == 0


def test_config_tokenizer(random_checkpoint, smollm2_dir):
    from tests.helpers import make_llm
    path = random_checkpoint("qwen3")[0]
    llm = make_llm(path, skip_tokenizer_init=False, tokenizer=smollm2_dir, num_kvcache_blocks=16)
    assert llm.tokenizer.encode("Paris") == make_llm(smollm2_dir, num_kvcache_blocks=16).tokenizer \
        .encode("Paris")
    with pytest.raises(TypeError, match="tokenizer"):
        make_llm(path, tokenizer=3)


def test_server_start_imports_while_building_and_freezes_the_engine(random_smol, smollm2_dir,
                                                                     monkeypatch):
    """By the time the server serves, its app was imported while the engine built (on a thread),
    and the engine's objects are out of the collector's reach: a full collection would walk them
    all, a stall of every request in the middle of serving."""
    import gc
    import sys

    from nanovllm.serve import cli
    monkeypatch.delitem(sys.modules, "nanovllm.serve.app", raising=False)
    seen = {}

    def run(coroutine):  # instead of serving: what holds when the server would start
        llm = coroutine.cr_frame.f_locals["llm"]
        coroutine.close()
        seen["app imported"] = "nanovllm.serve.app" in sys.modules
        seen["frozen"] = gc.get_freeze_count()
        model = llm.model_runner.model
        seen["model collectable"] = any(obj is model for obj in gc.get_objects())
        return {}
    monkeypatch.setattr(cli, "event_loop_runner", lambda: run)
    try:
        assert cli.main([random_smol, "--tokenizer", smollm2_dir, "--port", "0",
                         *SMALL_ENGINE]) == 0
    finally:
        gc.unfreeze()
    assert seen == {"app imported": True, "frozen": seen["frozen"], "model collectable": False}
    assert seen["frozen"] > 10_000
