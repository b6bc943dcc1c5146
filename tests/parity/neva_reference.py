"""Eager fp32 reference of a NeVA ``.nemo`` (the oracle of the NeVA parity tests), without NeMo or TensorRT-LLM.

What it follows, by original file / function:

- image: the seeds' run.py NeVA transform (TensorRT-LLM ``runtime/multimodal_model_runner.py``, ``model_type ==
  "neva"``: torchvision ``Resize((S, S), BICUBIC)``, ``ToTensor``, ``Normalize(mean, std)``), here with PIL + numpy
  (torchvision's Resize of a PIL image is PIL's bicubic resize) and the tower's preprocessor mean / std;
- tower + projector: NeMo ``neva_model.py: NevaWordEmbeddingMixin.encode_vision_x`` (HF tower,
  ``hidden_states[vision_select_layer]``, ``[:, class_token_length:]`` for "patch") and the mlp2x_gelu
  ``MultimodalProjectorAdapter`` (Linear, exact GELU, Linear); ``build_neva_engine`` loads the same tower folder;
- image entry: ``replace_media_embeddings`` / TRT's prompt table: the span's rows are the image features;
- decoder: Megatron-core ``GPTModel`` (``LanguageModelEmbedding`` without position embeddings for rope,
  ``TransformerBlock`` of pre-norm ``TransformerLayer`` s, ``final_layernorm``, ``output_layer``):
  ``SelfAttention.get_query_key_value_tensors`` (fused ``linear_qkv`` rows as ``[groups, q_per_group + 2,
  head_dim]``), ``RotaryEmbedding`` over ``int(kv_channels * rotary_percent)`` dims and
  ``apply_rotary_pos_emb_bshd`` (rotate-half on that first part, the rest passed through; transformers' Nemotron
  ``apply_rotary_pos_emb`` is the same function), causal softmax attention scaled by 1 / sqrt(head_dim),
  ``MLP`` (``squared_relu``, exact gelu, or GLU ``silu(gate) * up`` with fc1 = [gate; up]); layernorm1p is a
  LayerNorm with weight + 1 (transformers' ``NemotronLayerNorm1P``), rmsnorm as TE's.

Prompt ids follow :func:`mmserve.testing.neva.prompt_ids`. Every step runs the whole sequence again (no cache).
"""

from __future__ import annotations

import functools
import json
import tempfile

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from tokenizers import Tokenizer
from transformers import CLIPVisionModel, SiglipVisionModel
from transformers.models.nemotron.modeling_nemotron import NemotronLayerNorm1P, apply_rotary_pos_emb

from mmserve.models.nemo_archive import (
    iter_nemo_weights,
    nemo_file,
    nemo_tokenizer_file,
    read_nemo_config,
    vision_tower_dir,
)
from mmserve.testing.neva import EOS_TOKEN, prompt_ids

GATED = ("swiglu", "fast-swiglu")
PROJECTOR = "model.embedding.word_embeddings.adapter_layer.mm_projector_adapter.mm_projector"


def preprocess(
    image: Image.Image,
    size: int,
    mean: tuple[float, ...] = (0.5, 0.5, 0.5),
    std: tuple[float, ...] = (0.5, 0.5, 0.5),
) -> torch.Tensor:
    """[3, size, size] float32: RGB, bicubic resize straight to the square, /255, (x - mean) / std."""
    resized = image.convert("RGB").resize((size, size), Image.BICUBIC)
    x = np.asarray(resized, dtype=np.float32) / 255.0
    x = (x - np.asarray(mean, dtype=np.float32)) / np.asarray(std, dtype=np.float32)
    return torch.from_numpy(np.ascontiguousarray(x.transpose(2, 0, 1)))


class _RMSNorm(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = weight, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _norm(
    kind: str, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.nn.Module:
    if kind == "rmsnorm":
        return _RMSNorm(weight, eps)
    if kind not in ("layernorm", "layernorm1p"):
        raise ValueError(f"normalization {kind!r} not supported by the reference")
    cls = NemotronLayerNorm1P if kind == "layernorm1p" else torch.nn.LayerNorm
    norm = cls(weight.shape[0], eps=eps, bias=bias is not None).to(weight.device)
    with torch.no_grad():
        norm.weight.copy_(weight)
        if bias is not None:
            norm.bias.copy_(bias)
    return norm


class NevaReference:
    """A NeVA ``.nemo`` (and its vision tower folder) loaded for eager fp32 forwards."""

    def __init__(self, model_dir: str, device: str = "cpu") -> None:
        path = nemo_file(model_dir)
        self.cfg = cfg = read_nemo_config(path)
        self.device = device
        self.w = {k: v.to(device, torch.float32) for k, v in iter_nemo_weights(path)}
        with tempfile.TemporaryDirectory() as tmp:
            self.tokenizer = Tokenizer.from_file(str(nemo_tokenizer_file(path, tmp)))
        self.eos_ids = [self.tokenizer.token_to_id(EOS_TOKEN)]
        self.h = cfg["hidden_size"]
        self.heads = cfg["num_attention_heads"]
        self.groups = cfg.get("num_query_groups") or self.heads
        self.head_dim = cfg.get("kv_channels") or self.h // self.heads
        self.activation = cfg.get("activation", "gelu")
        self.eps = float(cfg.get("layernorm_epsilon", 1e-5))
        kind = cfg.get("normalization", "layernorm")
        if cfg.get("position_embedding_type", "learned_absolute") != "rope":
            raise ValueError("the reference supports rope position embeddings only")
        rot = int(self.head_dim * float(cfg.get("rotary_percentage", 1.0)))
        base = float(cfg.get("rotary_base", 10000))
        self.inv_freq = 1.0 / base ** (
            torch.arange(0, rot, 2, dtype=torch.float32, device=device) / rot
        )
        self.interpolation = float(cfg.get("seq_len_interpolation_factor") or 1.0)
        self.norms = {}
        for prefix in [
            f"model.decoder.layers.{i}.{m}.layer_norm_"
            for i in range(cfg["num_layers"])
            for m in ("self_attention.linear_qkv", "mlp.linear_fc1")
        ] + ["model.decoder.final_layernorm."]:
            self.norms[prefix] = _norm(
                kind, self.w[prefix + "weight"], self.w.get(prefix + "bias"), self.eps
            )
        shared = cfg.get("share_embeddings_and_output_weights", True)  # NeMo's default
        self.output = self.w[
            "model.embedding.word_embeddings.weight" if shared else "model.output_layer.weight"
        ]
        # vision tower and its preprocessing
        mm = cfg["mm_cfg"]
        if mm.get("mm_mlp_adapter_type") != "mlp2x_gelu":
            raise ValueError("the reference supports the mlp2x_gelu projector only")
        self.vision_cfg = mm["vision_encoder"]
        tower = vision_tower_dir(path, cfg)
        kind_v = json.loads((tower / "config.json").read_text())["model_type"]
        cls = SiglipVisionModel if kind_v.startswith("siglip") else CLIPVisionModel
        self.tower = cls.from_pretrained(tower, dtype=torch.float32).to(device).eval()
        pre = json.loads((tower / "preprocessor_config.json").read_text())
        self.image_size = self.tower.config.image_size
        self.mean, self.std = tuple(pre["image_mean"]), tuple(pre["image_std"])
        self.tokens_per_image = int(cfg["data"]["image_token_len"])

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[f"{name}.weight"], self.w.get(f"{name}.bias"))

    @torch.no_grad()
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """[n, T, hidden] projected features of [n, 3, S, S] pixels."""
        out = self.tower(pixel_values=pixels.to(self.device), output_hidden_states=True)
        feats = out.hidden_states[self.vision_cfg.get("vision_select_layer", -2)]
        if self.vision_cfg.get("vision_select_feature", "patch") == "patch":
            feats = feats[:, self.vision_cfg.get("class_token_length", 1) :]
        x = F.gelu(self.linear(feats, f"{PROJECTOR}.0"))
        return self.linear(x, f"{PROJECTOR}.2")

    def rotary(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(n, dtype=torch.float32, device=self.device) / self.interpolation
        freqs = pos[:, None] * self.inv_freq[None]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()

    def split_qkv(self, fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[L, (heads + 2 groups) head_dim] in Megatron's per-group layout -> q [heads, L, d], k, v [groups, L, d]."""
        per = self.heads // self.groups
        x = fused.view(fused.shape[0], self.groups, per + 2, self.head_dim)
        q = x[:, :, :per].reshape(fused.shape[0], self.heads, self.head_dim)
        return q.transpose(0, 1), x[:, :, per].transpose(0, 1), x[:, :, per + 1].transpose(0, 1)

    def attention(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Layer ``i``'s attention block (fused input norm through linear_proj) on [L, hidden]."""
        p = f"model.decoder.layers.{i}.self_attention."
        q, k, v = self.split_qkv(
            self.linear(self.norms[p + "linear_qkv.layer_norm_"](x), p + "linear_qkv")
        )
        cos, sin = self.rotary(x.shape[0])
        q, k = apply_rotary_pos_emb(q[None], k[None], cos[None], sin[None], unsqueeze_dim=1)
        rep = self.heads // self.groups
        k, v = k[0].repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        scores = q[0] @ k.transpose(1, 2) / self.head_dim**0.5
        causal = torch.ones(x.shape[0], x.shape[0], dtype=torch.bool, device=x.device).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out = (probs @ v).transpose(0, 1).reshape(x.shape[0], self.heads * self.head_dim)
        return self.linear(out, p + "linear_proj")

    def mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        p = f"model.decoder.layers.{i}.mlp."
        y = self.linear(self.norms[p + "linear_fc1.layer_norm_"](x), p + "linear_fc1")
        if self.activation in GATED:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        elif self.activation == "squared-relu":
            y = F.relu(y).pow(2)
        elif self.activation == "gelu":
            y = F.gelu(y)
        else:
            raise ValueError(f"activation {self.activation!r} not supported by the reference")
        return self.linear(y, p + "linear_fc2")

    @torch.no_grad()
    def logits(
        self,
        ids: list[int],
        spans: list[tuple[int, int]] = (),
        features: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[L, vocab] logits of ``ids`` with each span's rows replaced by that image's ``features``."""
        x = self.w["model.embedding.word_embeddings.weight"][torch.tensor(ids, device=self.device)]
        for j, (start, n) in enumerate(spans):
            if features is None or features.shape[1] != n:
                raise ValueError(f"span {j} of {n} rows has no image features of that length")
            x[start : start + n] = features[j]
        for i in range(self.cfg["num_layers"]):
            x = x + self.attention(i, x)
            x = x + self.mlp(i, x)
        return self.norms["model.decoder.final_layernorm."](x) @ self.output.T


@functools.lru_cache(maxsize=4)
def load_reference(model_dir: str, device: str = "cpu") -> NevaReference:
    """The cached :class:`NevaReference` of ``model_dir`` (the directory holding model.nemo) on ``device``."""
    return NevaReference(model_dir, device)


def reference_greedy(
    model_dir: str,
    prompt: str,
    images: list[Image.Image] | None,
    n: int,
    device: str = "cpu",
) -> tuple[list[int], list[int], torch.Tensor]:
    """(prompt ids, n greedy ids, [n, vocab] float32 log-softmax of each step's logits with EOS set to -inf
    first, as HF's min_new_tokens does) of ``prompt`` (``<image>`` where each of ``images`` goes)."""
    ref = load_reference(str(model_dir), device)
    ids, spans = prompt_ids(ref.tokenizer, prompt, ref.tokens_per_image)
    images = images or []
    if len(spans) != len(images):
        raise ValueError(f"the prompt has {len(spans)} <image> markers for {len(images)} images")
    features = None
    if images:
        pixels = torch.stack([preprocess(im, ref.image_size, ref.mean, ref.std) for im in images])
        features = ref.encode_images(pixels)
    seq, new, logprobs = list(ids), [], []
    for _ in range(n):
        last = ref.logits(seq, spans, features)[-1].float()
        last[ref.eos_ids] = float("-inf")
        lp = torch.log_softmax(last, dim=-1)
        token = int(lp.argmax())
        new.append(token)
        logprobs.append(lp.cpu())
        seq.append(token)
    return ids, new, torch.stack(logprobs) if logprobs else torch.empty(0, ref.output.shape[0])
