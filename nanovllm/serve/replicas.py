"""Data-parallel replicas behind one server (vLLM's data parallelism and its DP load balancing;
SGLang's cache-aware router): `nanovllm serve MODEL --data-parallel-size R` runs R engines, each in
a process of its own on its own GPU (or its group of tensor_parallel_size GPUs; on a CPU, its
share of the cores), and the server sends each request to one of them.

Routing (`--routing`). A replica's prefix cache only helps the requests that land on it, so by
default ("prefix") a request goes to the replica that last took a prompt with the same first KV
block (a hash of its token ids, remembered in an LRU map hash -> replica), unless that replica
holds BALANCE_SLACK more requests than the least loaded one (SGLang's balance threshold);
otherwise to the least loaded replica (its requests waiting or running; ties go to the one that
took fewer so far). "least-loaded" always takes the least loaded replica (vLLM's DP balancing),
so a shared prefix is cached, and computed, on every replica it reaches. The prompts of one HTTP
request go to one replica, so they are queued all or none.

Plumbing. The server process checks and tokenizes prompts itself (the input processor needs only the
config and the tokenizer) and sends a replica plain tuples down a pipe, through a sender thread so
the event loop never blocks on a full pipe; a reader thread per replica hands what the replica sends
back (step outputs, answers to calls) to the event loop. A replica's loop is engine_thread.py's:
run the commands that came, step, send the outputs; with nothing to do it blocks on its pipe. The
outputs go without their prompts, which the server holds and puts back: a prompt's token ids sent
with every token of every request (6 KB a token with 2,048-token prompts) would make the server's
reading of the pipe, not the engine, what bounds a replica, its loop blocked on its sends.
`Replicas` offers the server what `EngineThread` does (add, abort, abort_all, stats, health,
num_waiting, num_adding) and what the routes read of an engine (config, tokenizer), so app.py does
not know how many engines run.

A replica that dies (its pipe closes) is out of service: /health names it, its requests end with
an EngineFailure, new requests go to the others. A replica whose server dies sees its command pipe
close and exits. Replicas ignore SIGINT and SIGTERM: the server stops them when it has drained.
"""
import asyncio
import gc
import itertools
import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
from collections import OrderedDict
from dataclasses import replace

from nanovllm.core.requeue import abort_all
from nanovllm.serve.engine_thread import EngineFailure, settle

log = logging.getLogger("nanovllm.serve")
BALANCE_SLACK = 32       # requests a replica may hold above the least loaded and keep its prefixes
PREFIX_MEMORY = 1 << 16  # prefix hashes remembered (least recently routed forgotten first)
ROUTINGS = ("prefix", "least-loaded")  # --routing


def prefix_key(token_ids: list[int], block_size: int) -> int | None:
    """The hash of a prompt's first full KV block; None if it has none (nothing of it is cached)."""
    return hash(tuple(token_ids[:block_size])) if len(token_ids) >= block_size else None


def replica_devices(index: int, group_size: int, visible: list[str]) -> str:
    """CUDA_VISIBLE_DEVICES of replica `index`: its own group of `group_size` devices."""
    return ",".join(visible[index * group_size:(index + 1) * group_size])


class Router:
    """Which replica gets a prompt: with routing="prefix", the one that holds its prefix, else the
    least loaded; with routing="least-loaded", always the least loaded."""

    def __init__(self, block_size: int, routing: str = "prefix"):
        if routing not in ROUTINGS:
            raise ValueError(f"routing={routing!r}: use one of {', '.join(ROUTINGS)}")
        self.block_size = block_size
        self.by_prefix = routing == "prefix"
        self.owners: OrderedDict[int, int] = OrderedDict()  # prefix hash -> replica index

    def choose(self, token_ids: list[int], loads: dict[int, int], routed: dict[int, int]) -> int:
        """loads: each replica in service -> the requests it holds; routed: -> requests it took."""
        least = min(loads, key=lambda i: (loads[i], routed[i]))
        if not self.by_prefix:
            return least
        key = prefix_key(token_ids, self.block_size)
        owner = self.owners.get(key)
        keep = owner in loads and loads[owner] <= loads[least] + BALANCE_SLACK
        choice = owner if keep else least
        if key is not None:
            self.owners[key] = choice
            self.owners.move_to_end(key)
            if len(self.owners) > PREFIX_MEMORY:
                self.owners.popitem(last=False)
        return choice


# The replica's process

def run_replica(model: str, options: dict, commands, results, num_threads: int | None):
    """A replica's process: build the engine, report ready, serve commands until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server stops us when it has drained
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    import torch
    if num_threads:
        torch.set_num_threads(num_threads)
    from nanovllm import LLM
    try:
        llm = LLM(model, **options)
    except Exception as e:  # noqa: BLE001 (the server reports it and stops)
        results.send(("failed_start", f"{type(e).__name__}: {e}", None, 0))
        return
    gc.freeze()  # its objects out of the collector's reach while it serves, as cli.py has them
    results.send(("ready", llm.input_processor.num_kvcache_blocks, os.getpid(), 0))
    try:
        serve_commands(llm, commands, results)
    except (EOFError, BrokenPipeError):
        pass  # the server is gone
    finally:
        llm.shutdown()


def serve_commands(llm, commands, results):
    """Run the commands that came, then a step; block on the pipe while there is nothing to step.
    Every message back ends with the number of requests waiting (the server's waiting limit)."""
    def send(kind, a=None, b=None):
        if kind == "outputs":
            a = [replace(out, prompt=None, prompt_token_ids=None) for out in a]  # the server holds
        results.send((kind, a, b, len(llm.scheduler.waiting)))

    while True:
        while llm.is_finished() or commands.poll():
            name, *args = commands.recv()
            if name == "stop":
                return
            command(llm, name, args, send)
        try:
            outputs = llm.step()
        except Exception as e:  # noqa: BLE001 (a bug, not a bad request: those were refused)
            log.exception("an engine step failed; ending the requests it held")
            failed = abort_all(llm)
            send("failed", failed, f"the engine failed: {type(e).__name__}: {e}")
            continue
        if outputs:
            send("outputs", outputs)


def command(llm, name: str, args: list, send):
    """One command from the server: add, abort, abort_all or stats (the call id first, if any)."""
    if name == "abort":
        request_ids, notify = args
        send("outputs", aborted(llm, request_ids, notify))
        return
    call_id, *args = args
    try:
        if name == "add":
            result = queue_all(llm, *args)
        elif name == "abort_all":
            send("outputs", aborted(llm, list(llm.requests), notify=True))
            result = None
        else:
            assert name == "stats", name
            result = llm.get_stats()
    except Exception as e:  # noqa: BLE001 (the caller turns it into an HTTP error)
        send("result", call_id, (None, e))
    else:
        send("result", call_id, (result, None))


def queue_all(llm, request_ids: list[str], prompts: list[tuple], params):
    """Queue one request per (token ids, text) prompt, all or none."""
    added = []
    try:
        for request_id, (token_ids, text) in zip(request_ids, prompts):
            # made here: its sequence id is this engine's own
            seq = llm.input_processor.make_sequence(token_ids, params)
            seq.prompt = text
            llm.queue(seq, request_id)
            added.append(request_id)
    except BaseException:
        for request_id in added:
            llm.abort_request(request_id)
        raise


def aborted(llm, request_ids: list, notify: bool) -> list:
    """Abort these requests, freeing their blocks; with notify, their last outputs ("abort")."""
    outputs = []
    for request_id in request_ids:
        root = llm.requests.get(request_id)
        if root is not None and llm.abort_request(request_id) and notify:
            outputs.append(llm.output_processor.output(root))
    return outputs


# The server's side

class Replica:
    """The server's side of one replica: its process, its pipes, the requests it holds."""

    def __init__(self, index: int, process, commands, results):
        self.index, self.process, self.commands, self.results = index, process, commands, results
        self.pid = process.pid
        self.queues: dict[str, asyncio.Queue] = {}  # request id -> its outputs, until it ends
        self.prompts: dict[str, tuple] = {}  # request id -> (prompt, its token ids), as queues
        self.calls: dict[int, asyncio.Future] = {}  # call id -> its answer
        self.num_waiting = 0   # requests queued there and not yet scheduled (its last report)
        self.num_routed = 0    # requests sent to it since the server started
        self.error: str | None = None  # why it is out of service
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()

    def send(self, message):
        self.outbox.put(message)

    def forget(self, request_id: str) -> asyncio.Queue | None:
        """A request's queue (None if it is not held here), no longer held."""
        self.prompts.pop(request_id, None)
        return self.queues.pop(request_id, None)

    def send_forever(self):
        """The sender thread: messages in order, never blocking the event loop."""
        while (message := self.outbox.get()) is not None:
            try:
                self.commands.send(message)
            except OSError:  # it died: its reader thread reports it
                return


class Replicas:
    """R engine processes behind one server, with EngineThread's interface (see the docstring)."""

    def __init__(self, model: str, options: dict, size: int, routing: str = "prefix"):
        from nanovllm.config import Config
        from nanovllm.engine.input_processor import InputProcessor, load_tokenizer
        self.config = config = Config.from_options(model, **options)
        self.router = Router(config.kvcache_block_size, routing)
        tokenizer = config.tokenizer or model
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(tokenizer)
        self.call_ids = itertools.count()
        self.num_adding = 0  # requests handed over but not yet queued (the loop's count)
        self.stopping = False
        self.loop = None
        self.replicas = start_processes(model, options, size, config)
        num_blocks = min(self.wait_ready(r) for r in self.replicas)
        self.input_processor = InputProcessor(config, self.tokenizer, num_blocks)

    def wait_ready(self, replica: Replica) -> int:
        """Block until a replica has built its engine; its number of KV blocks."""
        try:
            kind, value, pid, _ = replica.results.recv()
        except EOFError:  # it died before it could say why
            replica.process.join()
            kind, value = "failed_start", f"exit code {replica.process.exitcode}"
        if kind != "ready":
            self.stop()
            raise RuntimeError(f"replica {replica.index} did not start: {value}")
        return value

    @property
    def num_waiting(self) -> int:
        return sum(r.num_waiting for r in self.replicas if r.error is None)

    def start(self):
        """Start the threads that talk to the replicas (on the running event loop)."""
        self.loop = asyncio.get_running_loop()
        for r in self.replicas:
            threading.Thread(target=r.send_forever, name=f"replica-{r.index}-send",
                             daemon=True).start()
            threading.Thread(target=self.read_forever, args=(r,), name=f"replica-{r.index}-read",
                             daemon=True).start()

    def stop(self, timeout: float = 10):
        """Tell every replica to stop (after the commands already sent), then wait for them."""
        self.stopping = True
        for r in self.replicas:
            if self.loop is not None:  # through the sender thread, after what it holds
                r.send(("stop",))
                r.send(None)
                continue
            try:
                r.commands.send(("stop",))
            except OSError:  # it has died already
                pass
        for r in self.replicas:
            r.process.join(timeout)
            if r.process.is_alive():
                log.warning("replica %d did not stop within %.0f s: killed", r.index, timeout)
                r.process.kill()
                r.process.join()

    shutdown = stop  # what cli.py calls on an engine

    def read_forever(self, replica: Replica):
        """The reader thread: each message to the loop, then the replica's end."""
        try:
            while True:
                message = replica.results.recv()
                self.loop.call_soon_threadsafe(self.received, replica, message)
        except (EOFError, OSError):
            pass
        replica.process.join()
        try:
            self.loop.call_soon_threadsafe(self.died, replica, replica.process.exitcode)
        except RuntimeError:  # the loop has closed: the server stopped
            pass

    def received(self, replica: Replica, message: tuple):
        kind, a, b, replica.num_waiting = message
        if kind == "outputs":
            for out in a:
                q = replica.queues.get(out.request_id)
                if q is not None:
                    out.prompt, out.prompt_token_ids = replica.prompts[out.request_id]
                    q.put_nowait(out)
                if out.finished:
                    replica.forget(out.request_id)
        elif kind == "result":
            settle(replica.calls.pop(a), *b)
        else:
            assert kind == "failed", kind
            for request_id in a:
                q = replica.forget(request_id)
                if q is not None:
                    q.put_nowait(EngineFailure(b))

    def died(self, replica: Replica, exitcode: int | None):
        if self.stopping:
            return
        replica.error = f"replica {replica.index} (pid {replica.pid}) died (exit code {exitcode})"
        log.error("%s; ending its %d requests", replica.error, len(replica.queues))
        failure = EngineFailure(replica.error)
        for q in replica.queues.values():
            q.put_nowait(failure)
        for future in replica.calls.values():
            settle(future, None, failure)
        replica.queues, replica.prompts, replica.calls, replica.num_waiting = {}, {}, {}, 0

    def call(self, replica: Replica, name: str, *args) -> asyncio.Future:
        """Send a command that answers; a future of its result (EngineFailure if it dies)."""
        future = self.loop.create_future()
        if replica.error is not None:
            future.set_exception(EngineFailure(replica.error))
            return future
        call_id = next(self.call_ids)
        replica.calls[call_id] = future
        replica.send((name, call_id, *args))
        return future

    def choose(self, token_ids: list[int]) -> Replica:
        serving = [r for r in self.replicas if r.error is None]
        if not serving:
            raise EngineFailure("every replica has died")
        loads = {r.index: len(r.queues) for r in serving}
        routed = {r.index: r.num_routed for r in serving}
        return self.replicas[self.router.choose(token_ids, loads, routed)]

    async def add(self, request_ids: list[str], prompts: list, params, queue: asyncio.Queue):
        """Queue one request per prompt on one replica, all or none (a ValueError or TypeError
        says why; EngineFailure if no replica serves). Checked and tokenized on a worker thread."""
        make = self.input_processor.make_sequence
        self.num_adding += len(prompts)
        replica = None
        try:
            seqs = await asyncio.to_thread(lambda: [make(prompt, params) for prompt in prompts])
            replica = self.choose(seqs[0].prompt_token_ids)
            replica.num_routed += len(request_ids)
            for request_id, seq in zip(request_ids, seqs):  # outputs may come before the answer
                replica.queues[request_id] = queue
                replica.prompts[request_id] = (seq.prompt, seq.prompt_token_ids)
            sent = [(seq.prompt_token_ids, seq.prompt) for seq in seqs]
            await self.call(replica, "add", request_ids, sent, params)
        except asyncio.CancelledError:  # the caller went away: what may have been queued goes
            self.abort(request_ids)
            raise
        except BaseException:
            for request_id in request_ids if replica is not None else ():
                replica.forget(request_id)
            raise
        finally:
            self.num_adding -= len(prompts)

    def abort(self, request_ids: list[str], notify: bool = False):
        """Abort requests wherever they are, freeing their blocks (as EngineThread.abort)."""
        for r in self.replicas:
            mine = [i for i in request_ids if i in r.queues]
            if mine and r.error is None:
                r.send(("abort", mine, notify))
                if not notify:
                    for request_id in mine:
                        r.forget(request_id)

    def abort_all(self) -> asyncio.Future:
        """Abort every request of every replica, each queue getting its last output."""
        calls = [self.call(r, "abort_all") for r in self.replicas if r.error is None]
        return asyncio.gather(*calls, return_exceptions=True)

    def health(self) -> list[str]:
        """What is out of service: one line per dead replica."""
        return [r.error for r in self.replicas if r.error is not None]

    async def stats(self) -> dict:
        """The totals over the replicas in service, and a `replicas` list of each one's figures."""
        async def one(r: Replica) -> dict:
            entry = {"replica": r.index, "pid": r.pid, "num_requests_routed": r.num_routed}
            try:
                return {**entry, "alive": True, **await self.call(r, "stats")}
            except EngineFailure as e:
                return {**entry, "alive": False, "error": str(e)}
        entries = await asyncio.gather(*(one(r) for r in self.replicas))
        totals = {}
        for entry in entries:
            if entry["alive"]:
                for name, value in entry.items():
                    if name not in ("replica", "pid", "alive") and isinstance(value, int | float):
                        totals[name] = totals.get(name, 0) + value
        if "prompt_tokens" in totals:
            totals["prefix_cache_hit_rate"] = (totals["cached_prompt_tokens"]
                                               / max(1, totals["prompt_tokens"]))
        return {**totals, "replicas": entries}


def start_processes(model: str, options: dict, size: int, config) -> list[Replica]:
    """Spawn the replicas (building their engines at once); each sees only its own GPUs."""
    context = mp.get_context("spawn")
    group = config.tensor_parallel_size
    num_threads = None
    if config.device == "cuda":
        import torch
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        visible = visible.split(",") if visible else [str(i) for i in range(
            torch.cuda.device_count())]
        if size * group > len(visible):
            raise ValueError(f"--data-parallel-size {size} with tensor_parallel_size={group} needs "
                             f"{size * group} GPUs; {len(visible)} are visible")
    else:  # the cores are shared out
        import torch
        num_threads = max(1, torch.get_num_threads() // size)
    replicas, saved = [], os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        for index in range(size):
            commands_out, commands_in = context.Pipe(duplex=False)
            results_out, results_in = context.Pipe(duplex=False)
            if config.device == "cuda":  # a spawned process takes the environment of its start
                os.environ["CUDA_VISIBLE_DEVICES"] = replica_devices(index, group, visible)
            process = context.Process(target=run_replica, name=f"nanovllm-replica-{index}",
                                      args=(model, options, commands_out, results_in, num_threads))
            process.start()
            commands_out.close()  # the replica's ends: our copies closed, its exit closes the pipe
            results_in.close()
            replicas.append(Replica(index, process, commands_in, results_out))
    finally:
        if config.device == "cuda":
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            if saved is not None:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved
    return replicas
