"""AsyncEngine: runs the Engine's step loop on a background thread and streams outputs to asyncio.

Frontends call `generate()` (an async iterator of cumulative RequestOutputs), `abort()`,
`add_lora_tensors()` (an adapter sent with a request, loaded on the engine thread between steps) and
`encode_media()` (pictures through the vision encoder alone, on the engine thread between steps).
Input preprocessing (image decoding, HF processor) runs in a worker thread, never on the event
loop and never on the engine thread, so a slow image does not stall decoding for everyone else.
A consumer that stops iterating (client disconnect, cancellation) aborts its request.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mmserve.core.outputs import PhaseTimes, RequestOutput
from mmserve.engine.engine import Engine
from mmserve.engine.model_info import ModelInfo
from mmserve.engine.stats_log import StatsLog
from mmserve.multimodal.prompt_media import aload_prompt_media
from mmserve.sampling_params import SamplingParams
from mmserve.worker.tp_workers import WorkerDied

logger = logging.getLogger(__name__)


class EngineStopped(RuntimeError):
    """The engine loop has died (a tensor-parallel worker exited, or an error outside any step): the server can
    serve no one. HTTP 503 / gRPC UNAVAILABLE, and /v2/health/ready says 503."""


class AsyncEngine:
    def __init__(self, engine: Engine, preprocess_workers: int = 2) -> None:
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._preprocess = ThreadPoolExecutor(
            preprocess_workers, thread_name_prefix="mmserve-preprocess"
        )
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mmserve-engine", daemon=True)
        self.dead_error: BaseException | None = None
        self._current: tuple | None = None  # the command the engine thread is handling
        # engine thread: requests whose call is timed (PhaseTimes) and has no first token yet, by request id
        self._timed: dict[str, tuple[Any, PhaseTimes]] = {}
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_info(self) -> ModelInfo:
        """The served model as the frontends see it (immutable)."""
        return self.engine.model_info

    def lora_names(self) -> list[str]:
        """The LoRA adapters loaded now."""
        return list(self.engine.lora.names)

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """The prompt dict {"prompt", "images", "videos"} of OpenAI-style chat `messages` in the checkpoint's
        chat format (ValueError when they do not fit it)."""
        return self.engine.inputs.apply_chat_template(messages)

    async def compile_guide(self, kind: str, guide: Any) -> None:
        """Compile a guided-decoding grammar off the event loop (ValueError when it is invalid); cached."""
        await asyncio.to_thread(self.engine.grammars.compile, kind, guide)

    async def generate(
        self,
        prompt: str | dict[str, Any],
        params: SamplingParams,
        request_id: str | None = None,
        phases: PhaseTimes | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its outputs until the finished one. `phases`: the served call's phase times,
        marked on the way (media, preprocessing, first scheduled, first token) and in each output's metrics.

        Raises ValueError/TypeError for bad input and EngineOverloaded when the queue is full,
        before the first output.
        """
        if self.dead_error is not None:
            raise EngineStopped(f"the engine loop has stopped: {self.dead_error}")
        started = time.time()
        inputs = await self.preprocess(prompt, phases)
        times = (started, time.time())  # for its trace (RequestMetrics)
        async for out in self.generate_processed(inputs, params, request_id, times, phases):
            yield out

    async def preprocess(self, prompt: str | dict[str, Any], phases: PhaseTimes | None = None):
        """Engine.preprocess on a preprocessing thread: the prompt's ProcessedInputs (its pictures loaded first, for
        every API, by `aload_prompt_media`)."""
        prompt = await aload_prompt_media(prompt, self.engine.inputs.media)
        if phases is not None:
            phases.mark("media_loaded")
        inputs = await asyncio.get_running_loop().run_in_executor(
            self._preprocess, self.engine.preprocess, prompt
        )
        if phases is not None:
            phases.mark("preprocessed")
        return inputs

    async def generate_processed(
        self,
        inputs,
        params: SamplingParams,
        request_id: str | None = None,
        preprocess_times: tuple[float, float] | None = None,
        phases: PhaseTimes | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """generate() for a prompt already preprocessed (ProcessedInputs); `preprocess_times`: when that ran."""
        if self.dead_error is not None:
            raise EngineStopped(f"the engine loop has stopped: {self.dead_error}")
        loop = asyncio.get_running_loop()
        rid = request_id or uuid.uuid4().hex
        if (
            params.guided_decoding_type is not None
        ):  # compiled here, so the engine thread only finds it cached
            await loop.run_in_executor(
                self._preprocess,
                self.engine.grammars.compile,
                params.guided_decoding_type,
                params.guided_decoding_guide,
            )
        stream: asyncio.Queue = asyncio.Queue()
        added = loop.create_future()
        add = ("add", rid, inputs, params, loop, stream, preprocess_times, phases, added)
        self._commands.put(add)
        finished = False
        try:
            await added
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                if phases is not None and item.metrics is not None:
                    item.metrics.phases = phases
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(rid)

    async def add_lora_tensors(self, name: str, weights, config) -> None:
        """Engine.add_lora_tensors, run on the engine thread between steps; raises its ValueError."""
        if self.dead_error is not None:
            raise EngineStopped(f"the engine loop has stopped: {self.dead_error}")
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._commands.put(("lora", name, weights, config, loop, done))
        await done

    async def encode_media(self, inputs) -> list:
        """Engine.encode_media (ProcessedInputs -> each picture's embeddings) on the engine thread between steps,
        never beside one; raises its ValueError."""
        if self.dead_error is not None:
            raise EngineStopped(f"the engine loop has stopped: {self.dead_error}")
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        # the caller's loop fifth and its future last, as "lora" (the engine loop's failure path reads them so)
        self._commands.put(("encode", inputs, None, None, loop, done))
        return await done

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it already finished). Safe from any thread."""
        self._commands.put(("abort", request_id))

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def step_stats(self) -> dict[str, dict[str, float]]:
        """Engine.step_stats.as_dict(): steps, tokens, host and device-wait seconds per step kind."""
        return self.engine.step_stats.as_dict()

    def shutdown(self) -> None:
        self._stopped.set()
        self._commands.put(("wake",))
        self._thread.join(timeout=10)
        self._preprocess.shutdown(wait=False, cancel_futures=True)

    # ---- engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        """The engine thread. If it ever dies, every waiting caller gets the error and health turns 503."""
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - the thread must report, not vanish
            logger.exception("the engine loop died")
            self.dead_error = e
            self._fail_all(e)
            pending = [self._current] if self._current is not None else []
            while True:  # the command being handled and callers still queued behind the failure
                try:
                    pending.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            for cmd in pending:
                if cmd[0] in (
                    "add",
                    "lora",
                    "encode",
                ):  # each carries the caller's loop fifth and its future last
                    loop, waiter = cmd[4], cmd[-1]
                    loop.call_soon_threadsafe(
                        _set_exception, waiter, RuntimeError(f"the engine loop died: {e}")
                    )

    def _loop(self) -> None:
        stats = StatsLog(self.engine)
        while not self._stopped.is_set():
            stats.tick()
            block = not self.engine.has_unfinished()
            try:
                cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
            except queue.Empty:
                cmd = None
            while cmd is not None:
                self._current = cmd
                self._handle(cmd)
                self._current = None
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    cmd = None
            if not self.engine.has_unfinished():
                continue
            try:
                step_start = time.monotonic()
                outputs = self.engine.step()
            except WorkerDied:  # no later step can run either: the loop dies, health turns 503
                raise
            except Exception as e:  # a failed step must not take the server down with it
                if (
                    self.engine.tp_workers is not None
                ):  # unless a collective failed because a worker is gone
                    self.engine.tp_workers.check_alive(wait_s=2.0)
                logger.exception("engine step failed; aborting the running requests")
                self._fail_all(e)
                continue
            if self._timed:
                self._mark_phases(step_start)
            self._deliver_all([(out.request_id, out, out.finished) for out in outputs])

    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, inputs, params, loop, stream, preprocess_times, phases, added = cmd
            try:
                req = self.engine.add_processed(rid, inputs, params)
            except Exception as e:
                loop.call_soon_threadsafe(_set_exception, added, e)
                return
            req.preprocess_times = preprocess_times
            if phases is not None:
                self._timed[rid] = (req, phases)
            self._streams[rid] = (loop, stream)
            loop.call_soon_threadsafe(_set_result, added, None)
        elif kind == "lora":
            _, name, weights, config, loop, done = cmd
            try:
                self.engine.add_lora_tensors(name, weights, config)
            except Exception as e:
                loop.call_soon_threadsafe(_set_exception, done, e)
                return
            loop.call_soon_threadsafe(_set_result, done, None)
        elif kind == "encode":
            _, inputs, _, _, loop, done = cmd
            try:
                embeddings = self.engine.encode_media(inputs)
            except Exception as e:
                loop.call_soon_threadsafe(_set_exception, done, e)
                return
            loop.call_soon_threadsafe(_set_result, done, embeddings)
        elif kind == "abort":
            self._timed.pop(cmd[1], None)
            out = self.engine.abort(cmd[1])
            if out is not None:
                self._deliver(cmd[1], out, last=True)

    def _mark_phases(self, step_start: float) -> None:
        """The timed requests' first scheduling (by the step just run, which schedules first: its start) and first
        token on the host (now, before it is delivered)."""
        now = time.monotonic()
        for rid, (req, phases) in list(self._timed.items()):
            if req.first_scheduled_time is not None:
                phases.mark("scheduled", step_start)
            if req.first_token_time is not None or req.finished:
                if req.first_token_time is not None:
                    phases.mark("first_token", now)
                del self._timed[rid]

    def _deliver(self, rid: str, item: RequestOutput | BaseException, last: bool) -> None:
        self._deliver_all([(rid, item, last)])

    def _deliver_all(self, items: list[tuple[str, RequestOutput | BaseException, bool]]) -> None:
        """Hand (request id, output or error, is last) to their streams: one wake-up per event loop for
        the whole step, not one per token."""
        by_loop: dict = {}
        for rid, item, last in items:
            entry = self._streams.pop(rid, None) if last else self._streams.get(rid)
            if entry is not None:
                by_loop.setdefault(entry[0], []).append((entry[1], item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the consumer's loop is closed
                pass

    def _fail_all(self, error: BaseException) -> None:
        self._timed.clear()
        for rid in list(self._streams):
            try:
                self.engine.abort(rid)
            finally:
                self._deliver(rid, RuntimeError(f"engine step failed: {error}"), last=True)


def _put_all(batch: list) -> None:
    for stream, item in batch:
        stream.put_nowait(item)


def _set_result(fut: asyncio.Future, value: object) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, error: BaseException) -> None:
    if not fut.done():
        fut.set_exception(error)
