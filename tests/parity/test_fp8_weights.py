"""FP8 (e4m3) W8A8 decoder weights: `quantization="fp8"` and FP8 checkpoints (ModelOpt and llm-compressor
layouts) give the logits of transformers whose decoder projections compute with the same FP8 weights and
activations rounded to e4m3 the same way (written here independently of mmserve's code)."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors import safe_open
from torch import nn

from mmserve import LLM
from mmserve.config import ModelConfig
from mmserve.testing.fp8 import write_fp8_checkpoint
from tests.parity.fp8_case import DEVICES, FP8, PARAMS, PROMPT
from tests.parity.hf_oracle import hf_logits

_PROJ = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)")


class _Fp8Projection(nn.Module):
    """y = round_e4m3(x * (1 / s_x)) * s_x @ W^T: s_x per row (max|x| / 448) or static; W already dequantized.
    (Scaled by the fp32 reciprocal, as layers/fp8_linear.py defines it; x / s_x rounds ~1e-5 of elements to the
    neighbouring e4m3 value.)"""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, input_scale: float | None
    ) -> None:
        super().__init__()
        self.weight, self.bias, self.input_scale = weight, bias, input_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float()
        if self.input_scale is None:
            s = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0
        else:
            s = torch.full((len(rows), 1), self.input_scale, device=x.device)
        xq = (rows * (1.0 / s)).clamp(-448.0, 448.0).to(FP8).float() * s
        y = xq @ self.weight.float().t() + (self.bias.float() if self.bias is not None else 0.0)
        return y.to(x.dtype).reshape(*x.shape[:-1], -1)


def _per_row(w: torch.Tensor) -> tuple[torch.Tensor, None]:
    s = w.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0
    return (w.float() / s).clamp(-448.0, 448.0).to(FP8).float() * s, None


def _from_checkpoint(fp8_dir: str):
    """{(layer, proj): (dequantized weight, static input scale or None)} read from an FP8 checkpoint."""
    tensors = {}
    with safe_open(f"{fp8_dir}/model.safetensors", framework="pt") as f:
        for name in f.keys():
            tensors[name] = f.get_tensor(name)
    out = {}
    for name, t in tensors.items():
        m = _PROJ.search(name)
        if m and name.endswith(".weight") and t.dtype == FP8:
            prefix = name.removesuffix(".weight")
            scale = tensors[prefix + ".weight_scale"].float()
            w = t.float() * (scale.reshape(-1, 1) if scale.numel() > 1 else scale)
            static = tensors.get(prefix + ".input_scale")
            out[(int(m.group(1)), m.group(3))] = (w, None if static is None else float(static))
    return out


def _hf_logits(model_dir: str, device: str, fp8=None) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' context and generation logits. `fp8`: "per_row" (every decoder projection quantized per
    output row, dynamic activations) or {(layer, proj): (weight, input scale)} for the listed ones."""

    def use_fp8_projections(model: nn.Module) -> None:
        lm = model.model.language_model
        for name, module in list(lm.named_modules()):
            m = _PROJ.fullmatch(name)
            if not (m and isinstance(module, nn.Linear)):
                continue
            spec = (
                _per_row(module.weight.data)
                if fp8 == "per_row"
                else fp8.get((int(m.group(1)), m.group(3)))
            )
            if spec is not None:
                setattr(
                    lm.get_submodule(name.rpartition(".")[0]),
                    m.group(3),
                    _Fp8Projection(spec[0].to(device), module.bias, spec[1]),
                )

    return hf_logits(
        model_dir,
        PROMPT,
        PARAMS.max_tokens,
        device,
        use_fp8_projections if fp8 is not None else None,
    )


def _decoder_linears(llm: LLM) -> dict[str, nn.Module]:
    from mmserve.models.quantization import decoder_linears

    return dict(decoder_linears(llm.engine.model))


def _check(
    out,
    want: tuple[torch.Tensor, torch.Tensor],
    plain: torch.Tensor,
    device: str,
    exact_on_cpu: bool = True,
) -> None:
    """exact_on_cpu False: static activation scales, whose coarse e4m3 steps an fp32 difference between the two
    attention implementations can cross (one such flip at one position moved logits by 0.17 on the CPU), so
    they are held to the statistical criterion below on the CPU too."""
    if device == "cpu" and exact_on_cpu:
        tol = 2e-3
        torch.testing.assert_close(out.context_logits, want[0], atol=tol, rtol=tol)
        torch.testing.assert_close(out.generation_logits, want[1], atol=tol, rtol=tol)
        # the FP8 rounding is really there: unquantized transformers is far outside the tolerance
        assert (out.context_logits - plain).abs().max() > 20 * tol
        return
    # GPU: FP8 tensor cores sum with ~14 mantissa bits (1e-4 relative per projection, tests/gpu), and each such
    # difference may move an activation of the next projection across an e4m3 rounding boundary (steps of
    # 6-12 %), so logits follow the oracle statistically: much closer to it than to unquantized transformers,
    # while a wrong scale or a missed quantization lands as far from it as the unquantized model is
    err = (out.context_logits - want[0]).abs().mean().item()
    quantization_effect = (out.context_logits - plain).abs().mean().item()
    print(f"mean |logit error| vs FP8 oracle {err:.4f}, vs unquantized {quantization_effect:.4f}")
    assert err < 0.5 * quantization_effect  # measured on an H100: 0.08-0.23 of it


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_quantization_at_load_matches_transformers_with_fp8_projections(tiny_llava_dir, device):
    # fp32 on the GPU too: the FP8 kernels run (they take any activation dtype) and the comparison with the
    # fp32 oracle is not blurred by fp16 rounding, which flips activations between e4m3 neighbours
    llm = LLM(tiny_llava_dir, device=device, dtype="float32", quantization="fp8")
    layers = _decoder_linears(llm)
    assert len(layers) == 4 * 3 and all(
        m.weight.dtype == FP8 and m.input_scale is None for m in layers.values()
    )
    model = llm.engine.model
    assert model.language_model.lm_head.weight.dtype != FP8  # LM head, vision tower and
    assert all(p.dtype != FP8 for p in model.vision_tower.parameters())  # projector keep the dtype
    assert all(p.dtype != FP8 for p in model.multi_modal_projector.parameters())
    out = llm.generate([PROMPT], PARAMS, use_tqdm=False)[0]
    assert llm.engine.kv.usage == 0
    _check(
        out,
        _hf_logits(tiny_llava_dir, device, "per_row"),
        _hf_logits(tiny_llava_dir, device)[0],
        device,
    )


@pytest.mark.parametrize("style", ["modelopt", "compressed-tensors"])
@pytest.mark.parametrize("device", DEVICES)
def test_fp8_checkpoint_loads_without_a_flag_and_matches_transformers(
    tiny_llava_dir, tmp_path, style, device
):
    """Per-tensor scales + static input scales (ModelOpt; layer 0's MLP left unquantized as an exporter's
    exclude list would) and per-channel scales with dynamic activations (llm-compressor)."""
    fp8_dir = str(
        write_fp8_checkpoint(
            tiny_llava_dir,
            tmp_path / style,
            style,
            exclude=("layers.0.mlp.",) if style == "modelopt" else (),
        )
    )
    llm = LLM(fp8_dir, device=device, dtype="float32")
    layers = _decoder_linears(llm)
    fp8 = {name for name, m in layers.items() if m.weight.dtype == FP8}
    want_fp8 = {
        n for n in layers if not (style == "modelopt" and n.startswith("model.layers.0.mlp."))
    }
    assert fp8 == want_fp8
    qkv = layers["model.layers.1.self_attn.qkv_proj"]
    if (
        style == "modelopt"
    ):  # q, k, v each bring their own per-tensor scale: three values over the fused rows
        assert qkv.weight_scale.unique().numel() == 3
        assert qkv.input_scale.item() == pytest.approx(4.0 / 448)
    else:
        assert qkv.input_scale is None and qkv.weight_scale.unique().numel() > 3
    # norms and SiLU-and-mul quantize for the FP8 linear they feed (fused kernels on GPUs), not for fp16 ones
    decoder = llm.engine.model.language_model.model.layers
    assert decoder[1].input_layernorm._consumer == (decoder[1].self_attn.qkv_proj,)
    assert decoder[1].post_attention_layernorm._consumer == (decoder[1].mlp.gate_up_proj,)
    assert decoder[1].mlp.act._consumer == (decoder[1].mlp.down_proj,)
    unquantized_mlp = style == "modelopt"
    assert bool(decoder[0].post_attention_layernorm._consumer) != unquantized_mlp
    assert bool(decoder[0].mlp.act._consumer) != unquantized_mlp
    out = llm.generate([PROMPT], PARAMS, use_tqdm=False)[0]
    _check(
        out,
        _hf_logits(tiny_llava_dir, device, _from_checkpoint(fp8_dir)),
        _hf_logits(tiny_llava_dir, device)[0],
        device,
        exact_on_cpu=style != "modelopt",
    )


def test_fp8_weights_take_one_byte_per_element(tiny_llava_dir):
    plain, fp8 = (
        LLM(tiny_llava_dir, device="cpu", dtype="float32", quantization=q) for q in (None, "fp8")
    )
    for name, layer in _decoder_linears(fp8).items():
        ref = _decoder_linears(plain)[name]
        assert layer.weight.shape == ref.weight.shape
        assert layer.weight.element_size() == 1 and ref.weight.element_size() == 4
        assert layer.weight_scale.shape == (ref.weight.shape[0],)


def test_unsupported_quantization_is_refused_by_name(tiny_llava_dir, tmp_path):
    import json
    import shutil

    with pytest.raises(ValueError, match="quantization"):
        ModelConfig(tiny_llava_dir, quantization="int3")
    awq = tmp_path / "awq"
    shutil.copytree(tiny_llava_dir, awq)
    config = json.loads((awq / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "version": "gemv", "bits": 4}
    (awq / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="AWQ version 'gemv'"):
        LLM(str(awq), device="cpu")


def test_fp8_checkpoint_missing_a_weight_scale_is_refused(tiny_llava_dir, tmp_path):
    from safetensors.torch import save_file

    fp8_dir = write_fp8_checkpoint(tiny_llava_dir, tmp_path / "broken", "compressed-tensors")
    with safe_open(str(fp8_dir / "model.safetensors"), framework="pt") as f:
        tensors = {
            n: f.get_tensor(n)
            for n in f.keys()
            if not n.endswith("layers.2.mlp.down_proj.weight_scale")
        }
    save_file(tensors, str(fp8_dir / "model.safetensors"))
    with pytest.raises(ValueError, match="layers.2.mlp.down_proj.weight_scale"):
        LLM(str(fp8_dir), device="cpu")
