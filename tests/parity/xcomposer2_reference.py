"""An eager float32 reference of InternLM-XComposer2-VL (the parity oracle of ``internlm/internlm-xcomposer2-vl-7b``
style checkpoints, e.g. :mod:`mmserve.testing.internlm_xcomposer2`'s), in plain PyTorch on transformers' blocks.

transformers has no InternLM2 / XComposer2 class and the hub's remote code must not run, so each piece follows the
original file and function it names:

- image transform: hub ``modeling_internlm_xcomposer2.py: InternLMXComposer2ForCausalLM.vis_processor`` (torchvision
  ``Resize((img_size, img_size), BICUBIC)``, ``ToTensor``, ``Normalize`` with CLIP mean/std; no crop), done here
  with PIL's bicubic resize (what torchvision calls for a PIL image) and numpy: :func:`preprocess`.
- tower: hub ``build_mlp.py: CLIPVisionTower`` (``transformers.CLIPVisionModel``; ``feature_select``:
  ``hidden_states[-1]``, the last layer without post-layernorm, CLS dropped) and ``build_vision_projector``
  (``mlp2x_gelu``: Linear, GELU, Linear = ``vision_proj.{0,2}``); ``img2emb``.
- prompt: hub ``modeling_internlm_xcomposer2.py: interleav_wrap_chat`` (split on ``<ImageHere>``, text parts
  tokenized apart, image embeddings in between, ``im_mask`` 1 on their rows), with the id convention of
  :func:`mmserve.testing.internlm_xcomposer2.prompt_ids` (placeholder ids = unk) shared with the engine.
- decoder: hub ``modeling_internlm2.py``: ``InternLM2Attention.forward`` (packed ``wqkv`` output rearranged
  ``b q (h gs d) -> b q h gs d`` with gs = q-per-kv + 2: queries, then key, then value; rotate-half rotary with
  ``rope_theta``; grouped K/V repeated; causal softmax), ``InternLM2MLP.forward`` (``w2(silu(w1 x) * w3 x)``),
  ``InternLM2DecoderLayer`` (pre-norm residual blocks, ``attention_norm`` / ``ffn_norm`` RMSNorm), ``norm`` and
  ``output``. The unpacking here is on the projection's output, as the original does it, not by de-interleaving the
  weights, so it checks :func:`~mmserve.testing.internlm_xcomposer2.deinterleave_wqkv` independently.
- Partial LoRA: hub ``build_mlp.py: PLoRA.forward``: ``res = W x``; on ``im_mask`` rows ``res += Plora_B(Plora_A(x))
  * lora_scaling`` on all five linears of every layer. ``lora_scaling`` = lora_alpha / lora_r = 256 / 256 = 1, fixed
  in ``modeling_internlm2.py`` whatever the rank on disk (:data:`PLORA_SCALING`). Generated tokens are never image
  rows (``chat`` decodes with the cache and no image rows), so they use the base weights only.

Every step reruns the whole sequence (no KV cache); the rows of earlier steps are computed exactly as with one.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn
from transformers import CLIPVisionModel, PreTrainedTokenizerFast
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from mmserve.testing.internlm_xcomposer2 import (
    IMAGE_TAG,
    load_xcomposer2_weights,
    prompt_ids,
    tokens_per_image,
    vision_tower_config,
)

CLIP_MEAN = np.array([0.48145466, 0.4578275, 0.40821073], dtype=np.float32)
CLIP_STD = np.array([0.26862954, 0.26130258, 0.27577711], dtype=np.float32)
PLORA_SCALING = 256 / 256  # modeling_internlm2.py: PLoRA(..., lora_r=256, lora_alpha=256)
VIT_PREFIX = "vit.vision_tower.vision_model."


@dataclass
class _Model:
    cfg: dict
    tokenizer: PreTrainedTokenizerFast
    eos_ids: list[int]
    weights: dict[str, torch.Tensor]  # decoder tensors by on-disk name, float32 on the device
    norms: dict[str, LlamaRMSNorm]
    vit: CLIPVisionModel
    proj: nn.Sequential
    device: str


def preprocess(image: Image.Image, img_size: int) -> torch.Tensor:
    """The pixels [3, img_size, img_size] float32 of ``vis_processor``: bicubic resize of the RGB image to a square
    (no crop, aspect ratio not kept), scaled to [0, 1], normalised with CLIP's mean and std."""
    img = image.convert("RGB").resize((img_size, img_size), Image.BICUBIC)
    x = np.asarray(img, dtype=np.float32) / np.float32(255.0)
    x = (x - CLIP_MEAN) / CLIP_STD
    return torch.from_numpy(np.ascontiguousarray(x.transpose(2, 0, 1)))


@functools.lru_cache(maxsize=4)
@torch.no_grad()
def _load(model_dir: str, device: str) -> _Model:
    d = Path(model_dir)
    cfg = json.loads((d / "config.json").read_text())
    if cfg.get("rope_scaling") is not None:
        raise NotImplementedError(
            "the reference has no dynamic-NTK rotary (rope_scaling is null here)"
        )
    if cfg.get("bias"):
        raise NotImplementedError("the reference has no linear biases (InternLM2 bias=false)")
    eos = json.loads((d / "generation_config.json").read_text())["eos_token_id"]
    # the tokenizer files alone: AutoTokenizer would read config.json, whose auto_map asks for remote code
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    tensors = load_xcomposer2_weights(d)

    vc = vision_tower_config(cfg)
    vc._attn_implementation = "eager"
    vit = CLIPVisionModel(vc)
    vit.load_state_dict(
        {k.removeprefix(VIT_PREFIX): v for k, v in tensors.items() if k.startswith(VIT_PREFIX)}
    )
    hidden = cfg["hidden_size"]
    proj = nn.Sequential(nn.Linear(vc.hidden_size, hidden), nn.GELU(), nn.Linear(hidden, hidden))
    proj.load_state_dict(
        {
            k.removeprefix("vision_proj."): v
            for k, v in tensors.items()
            if k.startswith("vision_proj.")
        }
    )
    weights = {
        k: v.to(device, torch.float32)
        for k, v in tensors.items()
        if k.startswith(("model.", "output."))
    }
    norms = {}
    for k in weights:
        if k.endswith("norm.weight"):
            norm = LlamaRMSNorm(hidden, eps=cfg["rms_norm_eps"])
            norm.weight.data.copy_(weights[k])
            norms[k.removesuffix(".weight")] = norm.to(device)
    return _Model(
        cfg=cfg,
        tokenizer=tokenizer,
        eos_ids=[eos] if isinstance(eos, int) else list(eos),
        weights=weights,
        norms=norms,
        vit=vit.to(device, torch.float32).eval(),
        proj=proj.to(device, torch.float32).eval(),
        device=device,
    )


def _plora(m: _Model, name: str, x: torch.Tensor, im_mask: torch.Tensor) -> torch.Tensor:
    """``build_mlp.py: PLoRA.forward`` of the linear ``name`` on rows ``x`` [T, in]; ``im_mask`` [T] bool."""
    w = m.weights
    res = x @ w[f"{name}.weight"].T
    if im_mask.any():
        part = x[im_mask]
        delta = (part @ w[f"{name}.Plora_A.weight"].T) @ w[f"{name}.Plora_B.weight"].T
        res[im_mask] += delta * PLORA_SCALING
    return res


def _rotary(m: _Model, seq_len: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``InternLM2RotaryEmbedding``'s cos, sin [1, T, head_dim] of positions 0..T-1 (rope_scaling null)."""
    inv_freq = 1.0 / (
        m.cfg["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    )
    t = torch.arange(seq_len, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1).to(m.device)
    return emb.cos()[None], emb.sin()[None]


def _attention(m: _Model, p: str, x: torch.Tensor, im_mask: torch.Tensor) -> torch.Tensor:
    """``InternLM2Attention.forward`` of layer prefix ``p`` on x [T, hidden]."""
    cfg = m.cfg
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    groups, head_dim, seq = heads // kv_heads, cfg["hidden_size"] // heads, x.shape[0]
    qkv = _plora(m, f"{p}attention.wqkv", x, im_mask).view(seq, kv_heads, groups + 2, head_dim)
    q = qkv[:, :, :groups].reshape(seq, heads, head_dim).transpose(0, 1)[None]
    k = qkv[:, :, -2].transpose(0, 1)[None]
    v = qkv[:, :, -1].transpose(0, 1)[None]
    cos, sin = _rotary(m, seq, head_dim)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # repeat_kv
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(head_dim)
    causal = torch.ones(seq, seq, dtype=torch.bool, device=m.device).triu(1)
    scores = scores.masked_fill(causal, float("-inf")).softmax(dim=-1)
    out = (scores @ v)[0].transpose(0, 1).reshape(seq, heads * head_dim)
    return _plora(m, f"{p}attention.wo", out, im_mask)


def _mlp(m: _Model, p: str, x: torch.Tensor, im_mask: torch.Tensor) -> torch.Tensor:
    """``InternLM2MLP.forward``: w2(silu(w1 x) * w3 x), each a PLoRA."""
    gate = nn.functional.silu(_plora(m, f"{p}feed_forward.w1", x, im_mask))
    up = _plora(m, f"{p}feed_forward.w3", x, im_mask)
    return _plora(m, f"{p}feed_forward.w2", gate * up, im_mask)


def _decode(m: _Model, h: torch.Tensor, im_mask: torch.Tensor, last_only: bool) -> torch.Tensor:
    """``InternLM2Model`` + ``output`` on input embeddings h [T, hidden]: logits [T or 1, V] float32."""
    for i in range(m.cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = h + _attention(m, p, m.norms[f"{p}attention_norm"](h), im_mask)
        h = h + _mlp(m, p, m.norms[f"{p}ffn_norm"](h), im_mask)
    if last_only:
        h = h[-1:]
    return (m.norms["model.norm"](h) @ m.weights["output.weight"].T).float()


def _image_embeds(m: _Model, images: list[Image.Image]) -> list[torch.Tensor]:
    """``img2emb``: per image, vision_proj(CLIP's last hidden states without CLS) [n_img, hidden]."""
    out = []
    for image in images:
        pixels = preprocess(image, m.cfg["img_size"])[None].to(m.device)
        hidden = m.vit(pixel_values=pixels, output_hidden_states=True).hidden_states[-1]
        out.append(m.proj(hidden[0, 1:]))
    return out


def _prompt(
    m: _Model, prompt: str, images: list[Image.Image] | None
) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """(prompt ids, input embeddings [T, hidden], im_mask [T]) as ``interleav_wrap_chat`` builds them."""
    images = list(images or [])
    if prompt.count(IMAGE_TAG) != len(images):
        raise ValueError(
            f"the prompt has {prompt.count(IMAGE_TAG)} {IMAGE_TAG} but {len(images)} images were given"
        )
    ids, spans = prompt_ids(m.tokenizer, prompt, tokens_per_image(m.cfg))
    embeds = m.weights["model.tok_embeddings.weight"][torch.tensor(ids, device=m.device)]
    im_mask = torch.zeros(len(ids), dtype=torch.bool, device=m.device)
    for (offset, length), feats in zip(spans, _image_embeds(m, images)):
        assert feats.shape[0] == length, (feats.shape, length)
        embeds[offset : offset + length] = feats
        im_mask[offset : offset + length] = True
    return ids, embeds, im_mask


@torch.no_grad()
def reference_prompt_logits(
    model_dir: str, prompt: str, images: list[Image.Image] | None, device: str = "cpu"
) -> tuple[list[int], torch.Tensor]:
    """(prompt ids, [T, V] float32 logits of every prompt position), one pass with the image rows' Partial LoRA."""
    m = _load(str(model_dir), device)
    ids, embeds, im_mask = _prompt(m, prompt, images)
    return ids, _decode(m, embeds, im_mask, last_only=False).cpu()


@torch.no_grad()
def reference_greedy(
    model_dir: str,
    prompt: str,
    images: list[Image.Image] | None,
    n: int,
    device: str = "cpu",
) -> tuple[list[int], list[int], torch.Tensor]:
    """Returns (prompt ids, n new greedy ids, [n, V] float32 log-softmax of each step's logits), as
    ``tests/parity/hf_oracle.py: hf_greedy`` does.

    Every EOS id of ``generation_config.json`` is set to -inf before the log-softmax and the argmax (HF's
    ``min_new_tokens`` semantics): compare against mmserve run with min_tokens == max_tokens == n.
    """
    m = _load(str(model_dir), device)
    ids, embeds, im_mask = _prompt(m, prompt, images)
    table = m.weights["model.tok_embeddings.weight"]
    new_ids: list[int] = []
    logprobs = []
    for _ in range(n):
        logits = _decode(m, embeds, im_mask, last_only=True)[0]
        logits[m.eos_ids] = float("-inf")
        lp = torch.log_softmax(logits, dim=-1)
        token = int(lp.argmax())
        new_ids.append(token)
        logprobs.append(lp.cpu())
        embeds = torch.cat([embeds, table[token][None]])
        im_mask = torch.cat([im_mask, im_mask.new_zeros(1)])
    vocab = m.cfg["vocab_size"]
    return ids, new_ids, torch.stack(logprobs) if logprobs else torch.empty(0, vocab)
