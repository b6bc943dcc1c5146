"""The node layout of multi-node tensor parallelism (distributed/launch.py): flags over torchrun's and
LeaderWorkerSet's variables, which ranks and GPUs each node holds, and layouts that cannot work refused with the
flag or variable named (the subprocess checks of the same are in test_multinode_tensor_parallel.py)."""

from __future__ import annotations

import pytest

from mmserve.config import ModelConfig
from mmserve.distributed.launch import NodeLayout, apply_launcher_env, launcher_values
from mmserve.entrypoints.serve_args import build_engine_config, explain, parse_serve_args

TORCHRUN = {  # as torchrun --nnodes 2 --nproc-per-node 1 sets them on node 1
    "WORLD_SIZE": "2",
    "RANK": "1",
    "GROUP_RANK": "1",
    "LOCAL_RANK": "0",
    "LOCAL_WORLD_SIZE": "1",
    "MASTER_ADDR": "10.0.0.5",
    "MASTER_PORT": "29501",
}
LWS = {"LWS_GROUP_SIZE": "4", "LWS_WORKER_INDEX": "3", "LWS_LEADER_ADDRESS": "llm-0.llm.ns"}


def _args(argv: list[str], launcher_env: dict[str, str]):
    args = parse_serve_args(["/ckpt", *argv], environ={})
    apply_launcher_env(args, launcher_env)
    return args


def test_torchrun_and_leaderworkerset_variables_give_the_layout():
    assert {k: v for k, (v, _) in launcher_values(TORCHRUN).items()} == {
        "nnodes": 2,
        "node_rank": 1,
        "dist_init_addr": "10.0.0.5:29501",
    }
    assert {k: v for k, (v, _) in launcher_values(LWS).items()} == {
        "nnodes": 4,
        "node_rank": 3,
        "dist_init_addr": "llm-0.llm.ns:29500",
    }
    assert launcher_values({**LWS, "MASTER_PORT": "7000"})["dist_init_addr"][0].endswith(":7000")
    assert launcher_values({"PATH": "/bin"}) == {}


def test_flags_win_over_the_launchers_variables():
    args = _args(["--nnodes", "4", "--dist-init-addr", "head:1234"], TORCHRUN)
    assert (args.nnodes, args.node_rank, args.dist_init_addr) == (4, 1, "head:1234")
    assert args.sources["node_rank"] == "GROUP_RANK" and args.sources["nnodes"] == "--nnodes"
    env_flag = parse_serve_args(["/ckpt"], environ={"MMSERVE_NODE_RANK": "0"})
    apply_launcher_env(env_flag, TORCHRUN)  # MMSERVE_ variables are flags too
    assert env_flag.node_rank == 0 and env_flag.nnodes == 2


def test_each_node_holds_its_ranks_on_its_local_gpus():
    layout = NodeLayout(8, nnodes=2, node_rank=1, init_addr="[fd00::1]:29500")
    assert list(layout.node_ranks) == [4, 5, 6, 7] and layout.remote_ranks == [4, 5, 6, 7]
    assert [layout.local_rank(r) for r in layout.node_ranks] == [0, 1, 2, 3]
    assert layout.node_of(5) == 1 and layout.init_method() == "tcp://[fd00::1]:29500"
    one = NodeLayout.of(ModelConfig(model="/ckpt", tensor_parallel_size=2))
    assert (one.nnodes, one.per_node, one.remote_ranks, one.init_method()) == (1, 2, [], None)


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--tp-size", "4", "--nnodes", "3"], {}, "--nnodes: nnodes 3 does not divide"),
        (["--tp-size", "2", "--nnodes", "2", "--node-rank", "2"], {}, "--node-rank: node_rank"),
        (["--tp-size", "2", "--nnodes", "2"], {}, "--dist-init-addr HOST:PORT is needed"),
        (["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", "h:0"], {}, "--dist-init-addr: "),
        (["--nnodes", "0"], {}, "--nnodes: nnodes must be an integer >= 1"),
        (["--tp-size", "2"], {**TORCHRUN, "GROUP_RANK": "7"}, "GROUP_RANK: node_rank must be"),
        (["--tp-size", "3"], TORCHRUN, "WORLD_SIZE: nnodes 2 does not divide"),
        (["--tp-size", "2"], {**LWS, "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "x"}, "LWS_WORKER"),
    ],
)
def test_layouts_that_cannot_work_name_the_flag_or_variable(argv, env, message):
    args = parse_serve_args(["/ckpt", *argv], environ={})
    with pytest.raises(ValueError) as info:
        apply_launcher_env(args, env)
        build_engine_config(args)
    assert explain(info.value, args).startswith(message), str(info.value)
