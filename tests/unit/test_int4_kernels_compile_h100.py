"""The group-wise int4 kernels compiled for an H100 (sm_90a) on this CPU machine: Triton's interpreter (the other
unit tests) runs the Python of a kernel and accepts code the GPU compile refuses, such as a `triton.jit` helper
whose branches return different dtypes, so each constexpr path a launch can take is compiled here as well."""

from __future__ import annotations

import pytest

from mmserve.kernels.group_int4_dequant import _dequant_kernel
from mmserve.kernels.group_int4_gemm import _GEMM_CONFIGS, _gemm_kernel
from mmserve.kernels.group_int4_gemv import GEMV_CONFIGS, _gemv_kernel
from mmserve.testing.triton_h100 import compile_for_h100

DTYPES = {"fp16": "*fp16", "bf16": "*bf16"}
# (GROUP, HAS_G_IDX, PER_GROUP) as kernels/group_int4_gemm.check_layout sets them: groups of 128 (a K tile in one
# group: the scales loaded per row), of 32 (per column), act-order (g_idx), and one scale per row (GROUP = K)
LAYOUTS = [(128, False, True), (32, False, True), (128, True, False), (4096, False, False)]


def _layout_id(layout: tuple[int, bool, bool]) -> str:
    return f"g{layout[0]}{'_gidx' if layout[1] else ''}"


def _ptx(compiled) -> str:
    ptx = compiled.asm["ptx"]
    assert ".target sm_90a" in ptx
    return ptx


def _tiles(configs, keys):
    """One config per distinct (tile sizes, warps, stages) of these keys."""
    seen = {}
    for c in configs:
        seen.setdefault((tuple(c.kwargs[k] for k in keys), c.num_warps, c.num_stages), c)
    return list(seen.values())


@pytest.mark.parametrize("layout", LAYOUTS, ids=_layout_id)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_the_gemm_compiles_for_every_tile_and_layout(dtype, layout):
    group, has_g_idx, per_group = layout
    pointers = {"x_ptr": DTYPES[dtype], "w_ptr": "*u8", "s_ptr": "*fp16", "z_ptr": "*u8"}
    pointers |= {"g_ptr": "*i32", "b_ptr": DTYPES[dtype], "y_ptr": DTYPES[dtype]}
    configs = _tiles(_GEMM_CONFIGS, ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
    # the served fp16 groups of 128: every tile; else a decode and a prompt tile
    if dtype == "bf16" or layout != LAYOUTS[0]:
        configs = [configs[0], configs[-1]]
    for i, config in enumerate(configs):
        constants = dict(GROUP=group, HAS_G_IDX=has_g_idx, PER_GROUP=per_group, M_MAJOR=True)
        # a bias and split K on the first tile
        constants |= dict(HAS_BIAS=i == 0, SPLIT_K=2 if i == 0 else 1, PDL=0, **config.kwargs)
        compiled = compile_for_h100(
            _gemm_kernel,
            pointers,
            constants,
            aligned=("x_ptr", "w_ptr", "s_ptr", "z_ptr", "y_ptr", "N", "K", "stride_x", "stride_w"),
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
        assert "mma" in _ptx(compiled), config  # the dot on tensor cores, not unrolled FMAs


@pytest.mark.parametrize("layout", LAYOUTS[:3], ids=_layout_id)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_the_prompt_dequantization_compiles(dtype, layout):
    group, has_g_idx, _ = layout
    pointers = {"w_ptr": "*u8", "s_ptr": "*fp16", "z_ptr": "*u8", "g_ptr": "*i32"}
    pointers |= {"out_ptr": DTYPES[dtype]}
    compiled = compile_for_h100(
        _dequant_kernel,
        pointers,
        dict(GROUP=group, HAS_G_IDX=has_g_idx, BLOCK_N=16, BLOCK_B=64),
        aligned=("w_ptr", "out_ptr", "K", "stride_w", "stride_out"),
    )
    assert "st.global" in _ptx(compiled)


@pytest.mark.parametrize("layout", LAYOUTS, ids=_layout_id)
def test_the_gemv_compiles_for_every_tile(layout):
    group, has_g_idx, per_group = layout
    pointers = {"x_ptr": "*fp16", "w_ptr": "*u8", "s_ptr": "*fp16", "z_ptr": "*u8", "g_ptr": "*i32"}
    pointers |= {"b_ptr": "*fp16", "y_ptr": "*fp16"}
    configs = GEMV_CONFIGS if layout == LAYOUTS[0] else GEMV_CONFIGS[:1]
    for config in configs:
        constants = dict(GROUP=group, HAS_G_IDX=has_g_idx, PER_GROUP=per_group)
        constants |= dict(HAS_BIAS=True, PDL=0)
        _ptx(
            compile_for_h100(
                _gemv_kernel,
                pointers,
                constants | config.kwargs,
                aligned=("x_ptr", "w_ptr", "s_ptr", "z_ptr", "y_ptr", "N", "K", "stride_w"),
                num_warps=config.num_warps,
                num_stages=config.num_stages,
            )
        )
