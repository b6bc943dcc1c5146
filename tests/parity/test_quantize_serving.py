"""`mmserve quantize`'s checkpoints served by `mmserve.LLM` (CPU; gpu-marked on CUDA), against an oracle: the
smoothed checkpoint whose decoder weights are the written integers dequantized (written here from the quantized
files, in fp32).

Bounds. Derived, per served decoder linear on the input it is given, against x @ W_deq^T: AWQ (weight-only) is
exact up to float summation (atol 1e-4 on the CPU); SmoothQuant also rounds x per token to int8, |x^ - x| <= d / 2
with d = max|x| / 127, so |y - x W_deq^T| <= d / 2 * sum_j |W_ij| per output (plus float error). End to end: AWQ's
logits equal the oracle's up to float error (1e-3) with the same greedy tokens; SmoothQuant's per-token rounding
compounds through the layers, held to 10% of the logits' range (measured 4.3%). Against the fp model before
quantization (measured, not derived: this random model with weights of std 0.2 is harsh on int4): the largest
logit difference is at most 40% (AWQ, measured 29%) and 15% (SmoothQuant, measured 7%) of the logits' range."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.layers.group_int4 import dequantize_groups, unpack_awq
from mmserve.models.quantization import decoder_linears
from mmserve.quantize.options import QuantizeOptions
from mmserve.quantize.run import quantize_checkpoint
from mmserve.testing import make_llava_checkpoint, make_test_image
from tests.checkpoint_files import file_tensors

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
PROMPT = {
    "prompt": "USER: <image>\nwhat do you see here ASSISTANT:",
    "images": [make_test_image(5)],
}
FP_DRIFT = {"awq": 0.4, "smoothquant": 0.15}  # measured 0.29 and 0.07 of the logits' range (CPU)
PARAMS = SamplingParams(max_tokens=4, min_tokens=4, temperature=0.0, return_context_logits=True)


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return make_llava_checkpoint(
        tmp_path_factory.mktemp("serve_src"),
        preset="tiny-mha",
        text_hidden=128,
        text_intermediate=256,
    )


def _dequantized(folded: Path, quantized: Path, out: Path) -> Path:
    """The oracle: `folded` (the smoothed fp checkpoint) with each decoder weight replaced by the integers of
    `quantized` dequantized."""
    from safetensors.torch import save_file

    shutil.copytree(folded, out)
    written = file_tensors(quantized)
    for f in sorted(out.glob("*.safetensors")):
        tensors = file_tensors_of(f)
        for key in list(tensors):
            stem = key.removesuffix(".weight")
            if f"{stem}.qweight" in written:
                q, z, s = unpack_awq(
                    *(written[f"{stem}.{t}"] for t in ("qweight", "qzeros", "scales"))
                )
                tensors[key] = dequantize_groups(q, s, z, q.shape[1] // s.shape[1])
            elif f"{stem}.weight_scale" in written:
                tensors[key] = written[key].float() * written[f"{stem}.weight_scale"].float()
        save_file(tensors, str(f))
    return out


def file_tensors_of(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _serve(model_dir: Path, device: str, hook_inputs: bool = False):
    """(context logits, greedy ids, {decoder linear: (first input, its output, the module)})."""
    seen: dict[str, tuple] = {}
    with LLM(str(model_dir), device=device, enforce_eager=True, kv_cache_size_gb=0.05) as llm:
        handles = []
        if hook_inputs:
            for name, m in decoder_linears(llm.engine.model):

                def keep(mod, args, out, name=name):
                    seen.setdefault(name, (args[0].detach().float(), out.detach().float(), mod))

                handles.append(m.register_forward_hook(keep))
        out = llm.generate([PROMPT], PARAMS, use_tqdm=False)[0]
        for h in handles:
            h.remove()
        weights = (
            {}
            if hook_inputs
            else {n: (m.weight.float(), m.bias) for n, m in decoder_linears(llm.engine.model)}
        )
    return torch.as_tensor(out.context_logits).float(), out.outputs[0].token_ids, seen, weights


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["awq", "smoothquant"])
def test_quantized_checkpoint_serves_within_its_bound(src, tmp_path, device, method):
    common = dict(model=str(src), calib_size=3, device=device, group_size=64, method=method)
    quantize_checkpoint(QuantizeOptions(out=str(tmp_path / "folded"), fold_only=True, **common))
    quantize_checkpoint(QuantizeOptions(out=str(tmp_path / "q"), **common))
    oracle_dir = _dequantized(tmp_path / "folded", tmp_path / "q", tmp_path / "oracle")
    oracle, oracle_ids, _, weights = _serve(oracle_dir, device)
    served, served_ids, seen, _ = _serve(tmp_path / "q", device, hook_inputs=True)
    assert len(seen) == 12
    for name, (x, y, _) in seen.items():
        w, bias = weights[name]
        ref = x @ w.t() + (0 if bias is None else bias.float())
        if method == "awq":
            bound = torch.full_like(ref, 1e-4 if device == "cpu" else 2e-2)
        else:
            step = x.abs().amax(dim=1, keepdim=True) / 127
            bound = step / 2 * w.abs().sum(dim=1) + 1e-4
        assert bool(((y - ref).abs() <= bound).all()), (name, float((y - ref).abs().max()))
    span = float(oracle.max() - oracle.min())
    tol = (1e-3 if device == "cpu" else 2e-2) if method == "awq" else 0.1 * span
    torch.testing.assert_close(served, oracle, rtol=0, atol=tol)
    if (
        method == "awq"
    ):  # exact up to float error: the same greedy tokens (W8A8's may part on a near tie)
        assert served_ids == oracle_ids
    fp, _, _, _ = _serve(src, device)
    drift = float((served - fp).abs().max()) / float(fp.max() - fp.min())
    assert drift <= FP_DRIFT[method], drift
