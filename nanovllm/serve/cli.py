"""`python -m nanovllm.serve MODEL` (or `nanovllm serve MODEL`): the command line of the
OpenAI-compatible server, as vLLM's `vllm serve`, and how it stops.

Every engine option is a flag generated from Config (`--attn-backend triton`,
`--no-enable-prefix-caching`), its help text taken from Config's own comments, so a new option
needs no edit here. On SIGTERM or SIGINT the server stops accepting (new calls get 503), gives the
calls in flight a grace period (a second signal cuts it short), aborts the rest (their blocks
freed: streams end with finish_reason "abort" and [DONE], whole answers get 503), hangs up on
clients that still send or read nothing, prints the engine's figures and exits with status 0,
less than a second after the grace period. With --data-parallel-size R the same holds for all R
engines (nanovllm/serve/replicas.py).
"""
import argparse
import asyncio
import contextlib
import gc
import inspect
import ipaddress
import json
import logging
import os
import re
import sys
import threading
import types
import typing
from dataclasses import MISSING, fields

from nanovllm.config import Config
from nanovllm.serve.replicas import ROUTINGS, Replicas

SERVER_ONLY = {"model", "hf_config", "torch_dtype"}  # Config fields that are not flags
# Config fields whose "" lets the engine choose: "auto" on the command line
AUTO = [f.name for f in fields(Config) if typing.get_origin(f.type) is typing.Literal
        and typing.get_args(f.type)[0] == ""]
log = logging.getLogger("nanovllm.serve")


def config_comments() -> dict[str, str]:
    """Config's comments, by field (on the field's line or the line above it): the flags' help."""
    source = inspect.getsource(Config)
    above = re.findall(r"^\s+#\s*(.+)\n\s+(\w+):", source, re.MULTILINE)
    inline = re.findall(r"^\s+(\w+): [^#\n]*#\s*(.+)$", source, re.MULTILINE)
    return {**{name: text for text, name in above}, **dict(inline)}


def add_engine_flags(parser: argparse.ArgumentParser):
    """One flag per Config field; only the flags given reach Config (its defaults stay its own)."""
    group = parser.add_argument_group("engine options (nanovllm/config.py)")
    comments = config_comments()
    for f in fields(Config):
        if f.name in SERVER_ONLY:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = None if f.default is MISSING else f.default
        default = "auto" if default == "" and f.name in AUTO else default
        allowed = f.metadata["rule"][1] + "; " if "rule" in f.metadata else ""  # utils/checks.py
        comment = comments.get(f.name, "")
        comment = comment.replace('"":', "auto:", 1) if f.name in AUTO else comment
        help = f"{comment} ({allowed}default: {default!r})".lstrip()
        choices = None
        kind = f.type.__args__[0] if isinstance(f.type, types.UnionType) else f.type
        if typing.get_origin(f.type) is typing.Literal:  # a flag of strings: None is its absence
            choices, kind = [c for c in typing.get_args(f.type) if c is not None], str
            if f.name in AUTO:
                choices = ["auto", *choices[1:]]
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, help=help,
                               default=argparse.SUPPRESS)
        else:
            group.add_argument(flag, type=kind, choices=choices, help=help,
                               default=argparse.SUPPRESS, dest=f.name)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanovllm serve",
                                     description="An OpenAI-compatible server for one model.")
    parser.add_argument("model", help="the model directory (config.json, weights, tokenizer)")
    server = parser.add_argument_group("server options")
    server.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default: 127.0.0.1, this machine only)")
    server.add_argument("--port", type=int, default=8000, help="port (0: a free one; default 8000)")
    server.add_argument("--api-key", default=None,
                        help="callers of /v1/* must send 'Authorization: Bearer KEY' "
                             "(default: $NANOVLLM_API_KEY, else no key)")
    server.add_argument("--served-model-name", default=None,
                        help="the model's name in the API (default: the directory's name)")
    server.add_argument("--max-body-bytes", type=int, default=2 << 20,
                        help="larger request bodies get 413 (default: 2 MiB)")
    server.add_argument("--max-waiting-requests", type=int, default=1024,
                        help="beyond this many queued requests, new ones get 503 (default 1024)")
    server.add_argument("--grace-period", type=float, default=20.0,
                        help="seconds the requests in flight get to finish when stopping "
                             "(default 20)")
    server.add_argument("--data-parallel-size", type=int, default=1,
                        help="engines serving in processes of their own, each on its own GPUs "
                             "(nanovllm/serve/replicas.py); 1: one engine in this process "
                             "(default 1)")
    server.add_argument("--routing", default="prefix", choices=ROUTINGS,
                        help="which replica takes a request: the one that last took its first KV "
                             "block, else the least loaded (prefix), or always the least loaded "
                             "(least-loaded); with --data-parallel-size > 1 (default: prefix)")
    server.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"])
    server.add_argument("--access-log", action="store_true", help="log every HTTP request")
    add_engine_flags(parser)
    return parser


def engine_options(args: argparse.Namespace) -> dict:
    """The engine flags given on the command line, as Config options."""
    names = {f.name for f in fields(Config)} - SERVER_ONLY
    return {name: "" if name in AUTO and value == "auto" else value
            for name, value in vars(args).items() if name in names}


def check_server_args(args: argparse.Namespace):
    for name in ("max_body_bytes", "max_waiting_requests", "data_parallel_size"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, not {getattr(args, name)}")
    if args.grace_period < 0:
        raise SystemExit(f"--grace-period must be >= 0, not {args.grace_period}")
    if not 0 <= args.port < 65536:
        raise SystemExit(f"--port must be in [0, 65535], not {args.port}")


def exposed_without_key(host: str, api_key: str | None) -> bool:
    """Whether the server is reachable from other machines and lets anyone call it."""
    if api_key:
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return host != "localhost"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_server_args(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    api_key = args.api_key or os.environ.get("NANOVLLM_API_KEY") or None
    if exposed_without_key(args.host, api_key):
        print(f"WARNING: serving on {args.host} without an API key: anyone who can reach this "
              "machine can use the model. Pass --api-key KEY (or set NANOVLLM_API_KEY), or bind "
              "127.0.0.1.", file=sys.stderr, flush=True)
    options = {"log_stats": True, **engine_options(args)}  # /v1/stats counts tokens
    # the server's own imports (FastAPI, uvicorn: most of a second) run while the engine builds,
    # which leaves the interpreter free whenever it waits on the GPU
    server_imports = threading.Thread(target=import_server, daemon=True)
    server_imports.start()
    if args.data_parallel_size > 1:
        llm = Replicas(args.model, options, args.data_parallel_size, args.routing)
    else:
        from nanovllm import LLM
        llm = LLM(args.model, **options)
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    server_imports.join()
    # the engine's objects (modules, tensors, graphs: some 200,000) live as long as the server:
    # out of the collector's reach, a full collection no longer walks them all, a 130 ms stall of
    # every request in the middle of serving (vLLM's freeze_gc_heap; docs/benchmarks.md)
    gc.freeze()
    try:
        stats = event_loop_runner()(serve(llm, args, api_key, name))
    finally:
        llm.shutdown()
    print(f"nanovllm: stopped; engine figures: {json.dumps(stats)}", flush=True)
    gc.freeze()  # the interpreter's exit then skips collecting torch's objects: a second saved
    return 0


def import_server():
    """Import what `serve` imports (an import that fails here fails again there, and says why)."""
    with contextlib.suppress(Exception):
        import uvicorn  # noqa: F401

        import nanovllm.serve.app  # noqa: F401


def event_loop_runner():
    """uvloop's run where it is installed (uvicorn[standard], the serve extra), else asyncio's.
    With uvloop's loop and httptools' parser (uvicorn picks it itself) a streamed token, one
    server-sent event, costs the server's process about half the CPU it does with asyncio's and
    h11's (docs/scaling.md)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run
    return uvloop.run


async def serve(llm, args, api_key: str | None, name: str) -> dict:
    """Run the HTTP server until a signal stops it; the engine's figures at the end."""
    import uvicorn

    from nanovllm.serve.app import ServerState, build_app
    from nanovllm.serve.engine_thread import EngineThread
    # one engine: a thread of this process; replicas: their own processes, behind one object
    engine = EngineThread(llm, asyncio.get_running_loop()) if args.data_parallel_size == 1 else llm
    state = ServerState(llm, engine, name, api_key, args.max_body_bytes, args.max_waiting_requests)
    config = uvicorn.Config(build_app(state), host=args.host, port=args.port, lifespan="off",
                            log_level=args.log_level, access_log=args.access_log,
                            timeout_graceful_shutdown=1)
    server = GracefulServer(config, state, args.grace_period)
    engine.start()
    try:
        await server.serve()
        return await engine.stats()
    finally:
        engine.stop()


class GracefulServer:
    """uvicorn's Server, with our own answer to SIGTERM and SIGINT (see the module docstring)."""

    def __new__(cls, config, state, grace_period: float):
        import uvicorn

        class Server(uvicorn.Server):
            def handle_exit(self, sig, frame):  # runs in the main thread, the loop's own
                if self.draining is None:
                    self.draining = asyncio.ensure_future(self.drain())
                else:
                    self.cut_short.set()

            async def startup(self, sockets=None):
                await super().startup(sockets)
                if self.started:
                    host, port = self.servers[0].sockets[0].getsockname()[:2]
                    print(f"nanovllm: serving {state.model_name!r} on http://{host}:{port}",
                          flush=True)

            async def drain(self):
                state.stopping = True
                log.info("stopping: %d requests in flight get %.0f s", state.num_active,
                         grace_period)
                await self.until_idle(grace_period)
                # what is left of the stop takes less than a second, whatever the clients do
                try:
                    await asyncio.wait_for(state.engine.abort_all(), 0.3)  # after its step
                except asyncio.TimeoutError:
                    log.warning("the engine did not abort its requests within 0.3 s")
                await self.until_idle(0.1)  # aborted calls write their last bytes
                stalled = list(self.server_state.connections)  # clients that send or read no more
                if stalled:
                    log.info("stopping: hanging up on %d connections", len(stalled))
                for connection in stalled:
                    connection.transport.abort()
                self.should_exit = True

            async def until_idle(self, seconds: float):
                waiting = asyncio.ensure_future(self.cut_short.wait())
                loop = asyncio.get_running_loop()
                end = loop.time() + seconds
                while state.num_active and loop.time() < end and not waiting.done():
                    await asyncio.sleep(0.05)
                waiting.cancel()

        server = Server(config)
        server.draining, server.cut_short = None, asyncio.Event()
        return server
