"""Tensor-parallel worker processes: ranks 1..N-1 of `--tensor-parallel-size N`.

The engine's process is rank 0, the driver: it schedules, preprocesses, runs the vision encoders (with
`--mm-encoder-tp-mode data` every rank encodes a share of a step's pictures: encoder_sharding.py), samples, and
holds shard 0 of the language model. Each worker holds another shard and mirrors the driver's ModelRunner in
lockstep, so the collectives inside the forward passes (the row-parallel linears' all-reduces) meet:

- runner calls that run the model (activation profile, KV cache allocation, CUDA graph capture) are sent as
  ("call", name, args) and run by the worker's own ModelRunner with the same arguments;
- each step's forward is SPMD: the driver sends ("forward", StepInputs) — the pass and its host-side layout
  (positions, KV slots, block tables, query offsets) — over a pipe and broadcasts its device inputs (the
  embeddings, with the pictures already merged in by the driver, or a decode's fill of token ids sampled by the
  last step) from rank 0 over NCCL (gloo on the CPU), without a host sync; then every rank runs the same
  `step_execution.execute_step`.

Workers compute hidden states the driver also computes and drop them; sampling, logits and the encoder cache
live on the driver only. Under multi-node tensor parallelism the ranks on other nodes get the same messages over
torch.distributed instead of a pipe (`worker/tp_control.py`); those nodes run `worker/node_workers.py`.
"""

from __future__ import annotations

import faulthandler
import logging
import multiprocessing as mp
import os
import signal
import socket
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from mmserve.core.logs import configure_logging, current_logging
from mmserve.distributed import (
    TIMEOUT,
    init_tensor_parallel,
    shutdown_tensor_parallel,
    tp_broadcast,
)
from mmserve.distributed.launch import NodeLayout
from mmserve.worker.tp_control import ControlChannel, NodeControl, join_control_group

if TYPE_CHECKING:
    from mmserve.worker.encoder_sharding import EncodeShares
    from mmserve.worker.step_execution import StepInputs

logger = logging.getLogger(__name__)


class WorkerDied(RuntimeError):
    """A tensor-parallel worker process has exited: the group cannot run another forward (the server stops)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device of `rank`: GPU `rank` on CUDA, the CPU otherwise."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def check_tensor_parallel(hf_config, mc) -> None:
    """ValueError, before any process starts, when `mc.tensor_parallel_size` cannot shard this checkpoint."""
    from mmserve.models.loader import text_config_of
    from mmserve.models.registry import get_model_class

    size = mc.tensor_parallel_size
    cls = get_model_class(hf_config)
    text = text_config_of(hf_config)
    names = ["num_attention_heads", "attention_heads", "intermediate_size", "ffn_dim"]
    names += ["num_heads", "d_ff", "decoder_attention_heads", "decoder_ffn_dim"]  # T5, mBART
    if cls.family.cross_attention:  # the cross-attention pool holds each rank's kv heads
        names.append("num_key_value_heads")
    for name in names:
        value = getattr(text, name, None)
        if isinstance(value, int) and value % size:
            raise ValueError(
                f"tensor_parallel_size {size} does not divide the language model's {name} ({value})"
            )
    if mc.device.startswith("cuda:"):
        raise ValueError(
            f"tensor_parallel_size {size} uses GPUs 0..{size - 1}: give device 'cuda' or 'auto', "
            f"not {mc.device!r} (CUDA_VISIBLE_DEVICES picks which)"
        )


class TPWorkers:
    """The driver's handle on its worker processes (rank 0 joins the group in `start`), and on the ranks of the
    other nodes under multi-node tensor parallelism (`control`)."""

    def __init__(self, procs: list, conns: list, control: NodeControl | None = None) -> None:
        self.procs, self.conns, self.control = procs, conns, control

    @classmethod
    def start(cls, config, device: torch.device) -> TPWorkers:
        size = config.model.tensor_parallel_size
        layout = NodeLayout.of(config.model)
        if device.type == "cuda" and torch.cuda.device_count() < layout.per_node:
            raise ValueError(
                f"tensor_parallel_size {size} needs {layout.per_node} GPUs"
                f"{' on each of the nnodes' if layout.nnodes > 1 else ''}; "
                f"{torch.cuda.device_count()} visible"
            )
        init_method = layout.init_method() or f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        procs, conns = [], []
        for rank in range(1, layout.per_node):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=worker_main,
                args=(rank, size, init_method, config, device.type, child, current_logging()),
                name=f"mmserve-tp{rank}",
                daemon=True,
            )
            proc.start()
            procs.append(proc)
            conns.append(parent)
        if layout.nnodes > 1:
            logger.info(
                "waiting up to %d s for nodes 1..%d to join the tensor-parallel group at %s",
                TIMEOUT.total_seconds(),
                layout.nnodes - 1,
                layout.init_addr,
            )
        init_tensor_parallel(0, size, init_method, rank_device(device, 0))
        group = join_control_group(layout)
        return cls(procs, conns, NodeControl(group, layout) if group is not None else None)

    def call(self, name: str, *args: Any) -> Callable[[], list]:
        """Start runner.name(*args) on every worker and return a function that waits for their results. The
        driver runs the same call between the two: their collectives meet. Arguments go by pipe: host values only
        (a CUDA tensor would travel by CUDA IPC onto the driver's GPU)."""
        self.check_alive()
        for conn in self.conns:
            conn.send(("call", (name, args)))
        if self.control is not None:
            self.control.send(("call", (name, args)))
        control = self.control

        def wait() -> list:  # every reply is read before one's error is raised
            replies = [conn.recv() for conn in self.conns]
            return [self._reply(r) for r in replies + (control.replies() if control else [])]

        return wait

    def forward(self, inputs: StepInputs, tensors: list[torch.Tensor]) -> None:
        """Have every worker run this pass (ModelRunner.run_mirrored): `inputs` by pipe, then `tensors` by
        broadcast; the driver runs the same pass right after."""
        inputs.tensors = [(tuple(t.shape), t.dtype) for t in tensors]
        self._send_with_tensors("forward", inputs, tensors)

    def encode(self, shares: EncodeShares, tensors: list[torch.Tensor]) -> None:
        """Have every worker encode its share of a step's pictures (worker/encoder_sharding.py): `shares` by
        pipe, then their floating inputs by broadcast; the driver encodes its own share and gathers right after."""
        self._send_with_tensors("encode", shares, tensors)

    def _send_with_tensors(self, op: str, payload: Any, tensors: list[torch.Tensor]) -> None:
        self.check_alive()
        for conn in self.conns:
            conn.send((op, payload))
        if self.control is not None:
            self.control.send((op, payload))
        for t in tensors:
            tp_broadcast(t.contiguous())

    def check_alive(self, wait_s: float = 0.0) -> None:
        """WorkerDied when a worker has exited: the group cannot run a forward without it (its collectives would
        wait for that rank until they time out). `wait_s`: give a worker that is dying (a collective with it just
        failed) that long to be seen gone."""
        for rank, proc in enumerate(self.procs, start=1):
            if wait_s:
                proc.join(timeout=wait_s)
            if not proc.is_alive():
                raise WorkerDied(
                    f"tensor-parallel worker {rank} (pid {proc.pid}) exited with code {proc.exitcode}; "
                    "the engine cannot go on without it"
                )
        if self.control is not None:  # another node's ranks: can they still be sent a message?
            self.control.probe() if wait_s else self.control.check()

    def _reply(self, reply: tuple[str, Any]) -> Any:
        status, value = reply
        if status == "error":
            raise RuntimeError(f"tensor-parallel worker failed:\n{value}")
        return value

    def close(self) -> None:
        """Stop the workers and leave the group. Every rank destroys its communicator at the same time (NCCL's
        teardown waits on the peers); when a worker is already gone the group is aborted instead, which waits on
        no one."""
        for conn in self.conns:
            try:
                conn.send(("stop", None))
            except (BrokenPipeError, OSError):
                pass
        alive = all(proc.is_alive() for proc in self.procs)
        if self.control is not None:
            try:
                self.control.send(("stop", None))
            except WorkerDied:
                alive = False
        shutdown_tensor_parallel(abort=not alive)
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        self.procs, self.conns, self.control = [], [], None


def worker_main(
    rank: int,
    size: int,
    init_method: str,
    config,
    device_type: str,
    conn,
    log: tuple[str, str] = ("info", "text"),
) -> None:
    """A worker's life: join the group, build shard `rank` of the model and its ModelRunner, then serve the
    driver's calls and forwards until told to stop. `conn` None: a rank on another node, whose messages come
    over torch.distributed (worker/tp_control.py) instead of a pipe. `log`: the spawning process's (level,
    format)."""
    from mmserve.lora import LoRAManager
    from mmserve.models.loader import load_model
    from mmserve.worker.encoder_sharding import encode_mirrored, encoders_split
    from mmserve.worker.model_runner import ModelRunner

    layout = NodeLayout.of(config.model)
    configure_logging(*log, origin=f"tp{rank} node{layout.node_rank}")
    faulthandler.register(
        signal.SIGUSR1, all_threads=True
    )  # `kill -USR1 <pid>`: where is this worker stuck?
    device = rank_device(torch.device(device_type), layout.local_rank(rank))
    # the driver keeps its threads (it preprocesses and, on the CPU, computes shard 0); N processes that each
    # spin up a thread per core starve one another
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // layout.per_node))
    if layout.nnodes > 1:
        logger.info(
            "joining the tensor-parallel group at %s (waits up to %d s for every rank)",
            layout.init_addr,
            TIMEOUT.total_seconds(),
        )
    init_tensor_parallel(rank, size, init_method, device)
    control = join_control_group(layout)
    if conn is None:
        conn = ControlChannel(control, layout, rank)
    logger.info("joined the tensor-parallel group as rank %d of %d on %s", rank, size, device)
    mc = config.model
    loaded = load_model(mc, device)
    split = encoders_split(mc, loaded.model)  # --mm-encoder-tp-mode data: this rank encodes a share
    if not split:
        loaded.model.drop_encoders()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    runner = ModelRunner(
        loaded.model,
        device,
        loaded.dtype,
        config.cache,
        loaded.text_config.vocab_size,
        mc.attention_backend,
    )
    runner.lora = LoRAManager(
        loaded.model, device, loaded.dtype, mc.max_loras
    )  # the driver's adapters, sharded
    if split:  # the driver caches the embeddings: no cache here, none in this rank's profile
        runner.encoder.cache.capacity = 0
    logger.info(
        "shard %d of %d loaded%s",
        rank,
        size,
        " with the vision encoders (mm_encoder_tp_mode data)" if split else "",
    )
    with torch.inference_mode():
        while True:
            try:
                op, payload = conn.recv()
            except EOFError:  # the driver is gone without a word: no peer to leave the group with
                logger.warning("tensor-parallel rank %d: the driver went away; exiting", rank)
                os._exit(0)
            if op == "stop":
                break
            if op == "ping":  # the driver checks that this node is still there
                continue
            if op in ("forward", "encode"):
                try:
                    if op == "forward":
                        runner.run_mirrored(payload)
                    else:
                        encode_mirrored(runner.encoder, payload)
                except (
                    Exception
                ):  # the group cannot go on without this rank: exit (no teardown, which would
                    logger.exception(
                        "tensor-parallel rank %d: a forward failed", rank
                    )  # wait on the driver),
                    os._exit(1)  # so the driver's next step sees a dead worker
                continue
            name, args = payload
            try:
                result = getattr(runner, name)(*args)
                logger.info("%s done", name)
                conn.send(("ok", result))
            except Exception:  # the driver raises it; this worker stays to be stopped
                conn.send(("error", traceback.format_exc()))
    runner.release_cuda_graphs()
    shutdown_tensor_parallel()
