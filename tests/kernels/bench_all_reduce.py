"""All-reduce latency over two GPUs at decode-step sizes: NCCL against PyTorch's symmetric-memory one-shot and
two-shot kernels (fp16 staged as fp32: in PyTorch 2.11 they sum fp32 and bf16 only). GPU only; the measurement
behind docs/benchmarks.md "Tensor parallelism on two GPUs" (tensor parallelism keeps NCCL: the faster kernel in
isolation did not make a decode step faster).

`PYTHONPATH=. python3 -m tests.kernels.bench_all_reduce [--rows 1,8,32,64,128,256,512,2048] [--hidden 4096]`.
Prints µs per all-reduce of rows x hidden fp16 values, from CUDA-graph replays of 64 chained all-reduces (a
7B decode step's count) on rank 0; the copy into the symmetric buffer is included, as any caller would pay it.
"""

from __future__ import annotations

import argparse
import socket

import torch
import torch.multiprocessing as mp

CHAIN = 64


def _time_us(fn, x: torch.Tensor, device: torch.device) -> float:
    import torch.distributed as dist

    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CHAIN):
            fn(x)
    graph.replay()
    torch.cuda.synchronize(device)
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    torch.cuda.synchronize(device)
    del graph
    return start.elapsed_time(end) * 1000 / (20 * CHAIN)


def _rank_main(rank: int, init_method: str, rows_list: list[int], hidden: int) -> None:
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", init_method=init_method, rank=rank, world_size=2, device_id=device
    )
    group = dist.group.WORLD.group_name
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        symm_mem.enable_symm_mem_for_group(group)
    nbytes = max(rows_list) * hidden * 4
    buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    symm_mem.rendezvous(buf, group)
    wide = torch.empty(nbytes // 4, dtype=torch.float32, device=device)

    def one_shot(x):
        if x.dtype == torch.float16:  # the kernel has no fp16: staged as fp32
            staged = buf[: x.numel() * 4].view(torch.float32)
            staged.copy_(x.view(-1))
            torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", group, wide[: x.numel()])
            x.view(-1).copy_(wide[: x.numel()])
            return
        staged = buf[: x.numel() * x.element_size()].view(x.dtype)
        staged.copy_(x.view(-1))
        torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", group, x.view(-1))

    def two_shot(x):
        staged = buf[: x.numel() * 4].view(torch.float32)
        staged.copy_(x.view(-1))
        torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", group)
        x.view(-1).copy_(staged)

    if rank == 0:
        print(
            f"{torch.cuda.get_device_name(device)} x2, torch {torch.__version__}: µs per all-reduce "
            f"(fp16 rows x {hidden}, graph of {CHAIN})"
        )
        print(
            "| rows | KiB (fp16) | NCCL fp16 | one-shot fp16 (as fp32) | two-shot fp16 (as fp32) | NCCL bf16 | "
            "one-shot bf16 |\n|---|---|---|---|---|---|---|"
        )
    for rows in rows_list:
        x = torch.randn(rows, hidden, device=device, dtype=torch.float16)
        times = [
            _time_us(fn, x, device) for fn in (lambda t: dist.all_reduce(t), one_shot, two_shot)
        ]
        xb = x.to(torch.bfloat16)
        times += [_time_us(fn, xb, device) for fn in (lambda t: dist.all_reduce(t), one_shot)]
        if rank == 0:
            print(
                f"| {rows} | {rows * hidden * 2 // 1024} | "
                + " | ".join(f"{t:.1f}" for t in times)
                + " |"
            )
    buf = None  # the closures above hold it: dropped before the group goes
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,32,64,128,256,512,2048")
    ap.add_argument("--hidden", type=int, default=4096)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    mp.spawn(_rank_main, args=(init, [int(r) for r in args.rows.split(",")], args.hidden), nprocs=2)


if __name__ == "__main__":
    main()
