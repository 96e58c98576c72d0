"""The one thread that owns the engine (vLLM's AsyncLLMEngine, in a thread instead of a process).

HTTP handlers run on the asyncio event loop; the engine is not thread-safe and its step blocks, so
it lives in a thread of its own. Prompts are tokenized on worker threads, never on this one.
Handlers hand it commands (add a request, abort one, call a function) through a locked list; the
thread runs them between steps, so requests from every HTTP client join the same steps (continuous
batching across clients). Each step's outputs go back to the loop in one `call_soon_threadsafe`,
onto each request's asyncio.Queue. With nothing to run the thread sleeps on a Condition: an idle
server uses no CPU. An exception in a command fails that command's caller; one in a step fails the
requests the engine holds, and the engine serves on.
"""
import asyncio
import logging
import threading
from dataclasses import replace

from nanovllm.core.requeue import abort_all
from nanovllm.outputs import RequestOutput

log = logging.getLogger("nanovllm.serve")


class EngineFailure(Exception):
    """A step raised: the requests the engine held are ended with this."""


class EngineThread:
    def __init__(self, llm, loop: asyncio.AbstractEventLoop):
        self.llm, self.loop = llm, loop
        self.wake = threading.Condition()
        self.commands: list = []  # callables, run by the engine thread before its next step
        self.queues: dict[str, asyncio.Queue] = {}  # request id -> its outputs (engine thread's)
        self.num_waiting = 0  # requests queued in the engine and not yet scheduled (a snapshot)
        self.num_adding = 0   # requests handed over but not yet queued (the loop's count)
        self.running = True
        self.thread = threading.Thread(target=self.run, name="nanovllm-engine", daemon=True)

    def start(self):
        self.thread.start()

    def stop(self):
        """End the thread after the commands already given (requests left are not stepped)."""
        with self.wake:
            self.running = False
            self.wake.notify()
        self.thread.join()

    def submit(self, command):
        with self.wake:
            self.commands.append(command)
            self.wake.notify()

    def call(self, fn) -> asyncio.Future:
        """Run fn() in the engine thread between steps; a future of its result or exception."""
        future = self.loop.create_future()

        def command():
            try:
                result = fn()
            except BaseException as e:  # noqa: BLE001 (the caller turns it into an HTTP error)
                self.loop.call_soon_threadsafe(settle, future, None, e)
            else:
                self.loop.call_soon_threadsafe(settle, future, result, None)
        self.submit(command)
        return future

    async def add(self, request_ids: list[str], prompts: list, params, queue: asyncio.Queue):
        """Queue one request per prompt, all or none (a ValueError or TypeError says why). The
        prompts are checked and tokenized on a worker thread (the input processor touches no engine
        state): a long prompt, or one refused, costs the requests already running no step. They
        count as waiting from the call on (`num_adding`)."""
        make = self.llm.input_processor.make_sequence
        self.num_adding += len(prompts)
        try:
            seqs = await asyncio.to_thread(lambda: [make(prompt, params) for prompt in prompts])
            await self.call(lambda: self.queue_all(request_ids, seqs, queue))
        except asyncio.CancelledError:  # the caller went away: what may have been queued goes
            self.abort(request_ids)
            raise
        finally:
            self.num_adding -= len(prompts)

    def queue_all(self, request_ids: list[str], seqs: list, queue: asyncio.Queue):
        """Queue the sequences (on the engine thread), all or none; count them as waiting before
        the caller stops counting them as being added."""
        added = []
        try:
            for request_id, seq in zip(request_ids, seqs):
                self.llm.queue(seq, request_id)
                added.append(request_id)
        except BaseException:
            for request_id in added:
                self.llm.abort_request(request_id)
            raise
        for request_id in added:
            self.queues[request_id] = queue
        self.num_waiting = len(self.llm.scheduler.waiting)

    def abort(self, request_ids, notify: bool = False):
        """Abort requests wherever they are, freeing their blocks; with notify, their queues get a
        last output (finish_reason "abort"). Returns at once; the engine thread does it."""
        log.debug("aborting %s", request_ids)
        self.submit(lambda: self.abort_now(request_ids, notify))

    def stats(self) -> asyncio.Future:
        """The engine's figures (LLM.get_stats), read between steps."""
        return self.call(self.llm.get_stats)

    def health(self) -> list[str]:
        """What is out of service: nothing (a failed step fails its requests, not the engine)."""
        return []

    def abort_all(self) -> asyncio.Future:
        """Abort every request in the engine, each queue getting its last output."""
        return self.call(lambda: self.abort_now(list(self.queues), notify=True))

    def abort_now(self, request_ids, notify: bool):
        delivered = []
        for request_id in request_ids:
            root, queue = self.llm.requests.get(request_id), self.queues.pop(request_id, None)
            if root is not None and self.llm.abort_request(request_id) and notify and queue:
                delivered.append((queue, self.llm.output_processor.output(root)))
        if delivered:
            self.loop.call_soon_threadsafe(deliver, delivered)

    def run(self):
        while True:
            with self.wake:
                while self.running and not self.commands and self.llm.is_finished():
                    self.wake.wait()
                if not self.running:
                    return
                commands, self.commands = self.commands, []
            for command in commands:
                try:
                    command()
                except Exception:  # an abort or a call failed: this thread must serve on
                    log.exception("an engine command failed")
            if not self.llm.is_finished():
                self.step()
            self.num_waiting = len(self.llm.scheduler.waiting)

    def step(self):
        try:
            outputs = self.llm.step()
        except Exception as e:  # a bug, not a bad request (those are refused when added)
            log.exception("an engine step failed; ending the requests it held")
            self.fail_all(EngineFailure(f"the engine failed: {type(e).__name__}: {e}"))
            return
        delivered = []
        for out in outputs:
            queue = self.queues.get(out.request_id)
            if queue is not None:
                delivered.append((queue, out))
            if out.finished:
                self.queues.pop(out.request_id, None)
        if delivered:
            self.loop.call_soon_threadsafe(deliver, delivered)

    def fail_all(self, error: Exception):
        failed = [(self.queues.pop(rid), error) for rid in list(self.llm.requests)
                  if rid in self.queues]
        abort_all(self.llm)
        self.loop.call_soon_threadsafe(deliver, failed)


def settle(future: asyncio.Future, result, error):
    if not future.cancelled():
        future.set_exception(error) if error is not None else future.set_result(result)


def deliver(outputs: list[tuple[asyncio.Queue, RequestOutput | Exception]]):
    for queue, out in outputs:
        queue.put_nowait(out)


def merge(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Two delta outputs of one request as one (a slow client reads what queued up at once)."""
    samples = []
    for a, b in zip(first.outputs, later.outputs):
        logprobs = None if a.logprobs is None else a.logprobs + b.logprobs
        samples.append(replace(b, text=a.text + b.text, token_ids=a.token_ids + b.token_ids,
                               logprobs=logprobs))
    return replace(later, outputs=samples)
