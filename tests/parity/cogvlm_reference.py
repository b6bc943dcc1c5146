"""An independent eager float32 reference of CogVLM / CogVLM2 (no transformers class exists): the parity tests'
oracle for checkpoints written by :mod:`mmserve.testing.cogvlm`.

It follows the original remote code (THUDM/cogvlm-chat-hf and THUDM/cogvlm2-llama3-chat-19B ``modeling_cogvlm.py``,
``visual.py``, ``util.py``), re-written from its description, not copied: the EVA2-CLIP tower, the GLU projector,
the visual-expert decoder (two weight sets per layer, chosen per row by ``get_expert_mask``), ``build_position_ids``
and ``build_conversation_input_ids`` (via :func:`mmserve.testing.cogvlm.prompt_ids`). transformers' Llama blocks are
reused where they fit (``LlamaRMSNorm``, ``apply_rotary_pos_emb``). Each step runs the whole sequence (no KV cache).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from mmserve.testing.cogvlm import (
    LANGUAGE_TOKEN_TYPE,
    VISION_TOKEN_TYPE,
    cogvlm_version,
    image_rows,
    kv_heads,
    load_cogvlm_config,
    prompt_ids,
    rope_base,
    tokenizer_dir,
)
from mmserve.testing.cogvlm_layout import GLU_LAYER_NORM_EPS
from mmserve.testing.recipe import CLIP_MEAN, CLIP_STD

L, V = LANGUAGE_TOKEN_TYPE, VISION_TOKEN_TYPE


def preprocess(image: Image.Image, image_size: int) -> torch.Tensor:
    """``build_conversation_input_ids``' transform: torchvision Resize((S, S), BICUBIC) (on a PIL image: PIL's
    bicubic resize), ToTensor, Normalize(CLIP mean, std) -> float32 [3, S, S]."""
    rgb = image.convert("RGB").resize((image_size, image_size), Image.BICUBIC)
    x = torch.from_numpy(np.asarray(rgb, dtype=np.float32) / 255.0).permute(2, 0, 1)
    return (x - torch.tensor(CLIP_MEAN)[:, None, None]) / torch.tensor(CLIP_STD)[:, None, None]


def reference_positions(token_type_ids: list[int]) -> list[int]:
    """modeling_cogvlm.py ``build_position_ids`` (no attention mask): the first and last row of an image span (boi,
    eoi) count as language; the position grows on every language row and on the first vision row after a language
    row -> bos 0, boi 1, every patch 2, eoi 3, text 4, ..."""
    t = list(token_type_ids)
    n = len(t)
    edge = [False] * n
    for i in range(n):  # a vision row next to a language row (or the sequence's end) is boi / eoi
        if t[i] == V and (i == 0 or t[i - 1] == L or i == n - 1 or t[i + 1] == L):
            edge[i] = True
    types = [L if e else x for x, e in zip(t, edge)]
    pos, out = 0, []
    for i in range(n):
        if i > 0 and (types[i] == L or (types[i] == V and types[i - 1] == L)):
            pos += 1
        out.append(pos)
    return out


def vision_expert_rows(token_type_ids: list[int]) -> list[bool]:
    """modeling_cogvlm.py ``get_expert_mask``: row i takes the vision expert iff it and row i + 1 are vision rows
    (boi and every patch; eoi, the last row of a span, and every decode row take the language expert)."""
    t = list(token_type_ids)
    return [t[i] == V and i + 1 < len(t) and t[i + 1] == V for i in range(len(t))]


@dataclasses.dataclass(frozen=True)
class CogVLMReference:
    """A loaded checkpoint: config fields, its float32 tensors by published name, tokenizer and EOS ids."""

    config: object
    weights: dict[str, torch.Tensor]
    tokenizer: PreTrainedTokenizerBase
    eos_ids: tuple[int, ...]
    device: str

    @property
    def version(self) -> int:
        return cogvlm_version(self.config)

    def w(self, name: str) -> torch.Tensor | None:
        return self.weights.get(name)

    # ---- visual.py: EVA2CLIPModel ----
    def encode_image(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[3, S, S] pixels -> [image_rows, hidden]: patch conv + CLS + positions (PatchEmbedding), post-norm
        layers (TransformerLayer), CLS dropped, v2's 2x2 stride-2 conv, GLU, then [boi, x, eoi]."""
        vc, w = self.config.vision_config, self.w
        p = "model.vision."
        x = F.conv2d(
            pixel_values[None].to(self.device),
            w(p + "patch_embedding.proj.weight"),
            w(p + "patch_embedding.proj.bias"),
            stride=vc["patch_size"],
        )
        x = x.flatten(2).transpose(1, 2)  # [1, grid**2, D]
        x = torch.cat([w(p + "patch_embedding.cls_embedding")[None], x], dim=1)
        x = x + w(p + "patch_embedding.position_embedding.weight")[None]
        for n in range(vc["num_hidden_layers"]):
            x = self._eva_layer(x, f"{p}transformer.layers.{n}.")
        x = x[:, 1:]
        if self.version == 2:  # EVA2CLIPModel.forward: grid view, conv, flatten
            b, s, d = x.shape
            g = int(round(s**0.5))
            x = x.view(b, g, g, d).permute(0, 3, 1, 2)
            x = F.conv2d(x, w(p + "conv.weight"), w(p + "conv.bias"), stride=2)
            x = x.flatten(2).transpose(1, 2)
        x = self._glu(x[0], p + "linear_proj.")
        return torch.cat([w(p + "boi")[0], x, w(p + "eoi")[0]], dim=0)

    def _eva_layer(self, x: torch.Tensor, p: str) -> torch.Tensor:
        """TransformerLayer: x + LN(attention(x)), then x + LN(mlp(x)) (the norm on the branch's output)."""
        vc, w = self.config.vision_config, self.w
        eps, heads = vc["layer_norm_eps"], vc["num_heads"]
        b, s, d = x.shape
        qkv = F.linear(
            x, w(p + "attention.query_key_value.weight"), w(p + "attention.query_key_value.bias")
        )
        q, k, v = qkv.view(b, s, 3, heads, d // heads).permute(
            2, 0, 3, 1, 4
        )  # Attention: [3, heads, hd]
        att = (
            torch.softmax((q * (d // heads) ** -0.5) @ k.transpose(-2, -1), dim=-1) @ v
        )  # full attention
        att = F.linear(
            att.transpose(1, 2).reshape(b, s, d),
            w(p + "attention.dense.weight"),
            w(p + "attention.dense.bias"),
        )
        x = x + F.layer_norm(
            att, (d,), w(p + "input_layernorm.weight"), w(p + "input_layernorm.bias"), eps
        )
        m = F.gelu(
            F.linear(x, w(p + "mlp.fc1.weight"), w(p + "mlp.fc1.bias"))
        )  # MLP: fc1, gelu, fc2
        m = F.linear(m, w(p + "mlp.fc2.weight"), w(p + "mlp.fc2.bias"))
        pn = "post_attention_layernorm."
        return x + F.layer_norm(m, (d,), w(p + pn + "weight"), w(p + pn + "bias"), eps)

    def _glu(self, x: torch.Tensor, p: str) -> torch.Tensor:
        """GLU: linear_proj -> LayerNorm norm1 -> GELU -> silu(gate_proj) * dense_h_to_4h -> dense_4h_to_h."""
        w = self.w
        x = F.linear(x, w(p + "linear_proj.weight"))
        x = F.gelu(
            F.layer_norm(
                x, x.shape[-1:], w(p + "norm1.weight"), w(p + "norm1.bias"), GLU_LAYER_NORM_EPS
            )
        )
        x = F.silu(F.linear(x, w(p + "gate_proj.weight"))) * F.linear(
            x, w(p + "dense_h_to_4h.weight")
        )
        return F.linear(x, w(p + "dense_4h_to_h.weight"))

    # ---- modeling_cogvlm.py: CogVLMModel / CogVLMForCausalLM ----
    def logits(
        self, ids: list[int], token_type_ids: list[int], pixel_values: torch.Tensor | None
    ) -> torch.Tensor:
        """[len(ids), vocab] float32 logits of one full-sequence forward (causal, positions and experts from the
        token types; the image's features replace the embeddings of its rows, in order)."""
        cfg, w, dev = self.config, self.w, self.device
        x = F.embedding(torch.tensor(ids, device=dev), w("model.embed_tokens.weight"))
        types = torch.tensor(token_type_ids, device=dev)
        if pixel_values is not None:
            x = x.clone()
            x[types == V] = self.encode_image(pixel_values)
        pos = torch.tensor(reference_positions(token_type_ids), device=dev)
        vis = torch.tensor(vision_expert_rows(token_type_ids), device=dev)
        cos, sin = self._rotary(pos)
        for n in range(cfg.num_hidden_layers):
            x = self._decoder_layer(x, f"model.layers.{n}.", vis, cos, sin)
        return F.linear(self._rms(x, "model.norm.weight"), w("lm_head.weight"))

    def _rotary(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """util.py FastRotaryEmbedding (non-interleaved, i.e. rotate-half over the whole head): inv_freq of the
        hard-coded base (10000 v1, 500000 v2) and the positions in float32."""
        hd = self.config.hidden_size // self.config.num_attention_heads
        inv = 1.0 / (
            rope_base(self.config)
            ** (torch.arange(0, hd, 2, dtype=torch.float32, device=self.device) / hd)
        )
        freqs = pos.to(torch.float32)[:, None] * inv[None]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos()[None], emb.sin()[None]  # [1, L, hd]

    def _rms(self, x: torch.Tensor, name: str) -> torch.Tensor:
        norm = LlamaRMSNorm(x.shape[-1], eps=self.config.rms_norm_eps).to(self.device)
        norm.weight.data = self.w(name)
        return norm(x)

    def _expert(self, x: torch.Tensor, vis: torch.Tensor, lang: str, vision: str) -> torch.Tensor:
        """An expert linear: the language weights on every row, the vision weights (+ bias if any) on ``vis`` rows."""
        out = F.linear(x, self.w(lang + ".weight"), self.w(lang + ".bias"))
        if vis.any():
            out[vis] = F.linear(x[vis], self.w(vision + ".weight"), self.w(vision + ".bias"))
        return out

    def _decoder_layer(
        self, x: torch.Tensor, p: str, vis: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """CogVLMDecoderLayer: RMSNorm -> VisionExpertAttention -> residual; RMSNorm -> VisionExpertMLP -> residual."""
        cfg = self.config
        heads, kvh = cfg.num_attention_heads, kv_heads(cfg)
        hd = cfg.hidden_size // heads
        a = p + "self_attn."
        h = self._rms(x, p + "input_layernorm.weight")
        qkv = self._expert(
            h, vis, a + "language_expert_query_key_value", a + "vision_expert_query_key_value"
        )
        q, k, v = qkv.split([heads * hd, kvh * hd, kvh * hd], dim=-1)  # v1: [q; k; v] by hidden
        q, k, v = (
            t.view(t.shape[0], -1, hd).transpose(0, 1)[None] for t in (q, k, v)
        )  # [1, H, L, hd]
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
        k, v = (
            t.repeat_interleave(heads // kvh, dim=1) for t in (k, v)
        )  # q head i reads kv head i // group
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        ctx = ctx[0].transpose(0, 1).reshape(x.shape[0], heads * hd)
        x = x + self._expert(ctx, vis, a + "language_expert_dense", a + "vision_expert_dense")
        h = self._rms(x, p + "post_attention_layernorm.weight")
        out = torch.empty_like(h)
        for rows, expert in ((~vis, "language_mlp"), (vis, "vision_mlp")):
            if rows.any():
                m = f"{p}mlp.{expert}."
                g = F.silu(F.linear(h[rows], self.w(m + "gate_proj.weight")))
                out[rows] = F.linear(
                    g * F.linear(h[rows], self.w(m + "up_proj.weight")),
                    self.w(m + "down_proj.weight"),
                )
        return x + out


def _checkpoint_tensors(model_dir: Path, device: str) -> dict[str, torch.Tensor]:
    index = model_dir / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.is_file()
        else ["model.safetensors"]
    )
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(
            {
                k: t.to(device=device, dtype=torch.float32)
                for k, t in load_file(str(model_dir / f)).items()
            }
        )
    return out


def _eos_ids(model_dir: Path, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    eos = json.loads((model_dir / "generation_config.json").read_text()).get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos]
    return tuple(dict.fromkeys([tokenizer.eos_token_id, *[i for i in ids if i is not None]]))


@functools.lru_cache(maxsize=4)
def load_reference(model_dir: str, device: str = "cpu") -> CogVLMReference:
    """The checkpoint at ``model_dir`` loaded in float32 on ``device`` (cached per (model_dir, device))."""
    root = Path(model_dir)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir(root), trust_remote_code=False)
    return CogVLMReference(
        load_cogvlm_config(root),
        _checkpoint_tensors(root, device),
        tok,
        _eos_ids(root, tok),
        device,
    )


def reference_prompt(
    ref: CogVLMReference, prompt: str, images: list[Image.Image] | None
) -> tuple[list[int], list[int], torch.Tensor | None]:
    """(ids, token types, pixels or None) of ``prompt`` (taken verbatim) with at most one image."""
    if images and len(images) > 1:
        raise ValueError("CogVLM takes at most one image per prompt")
    if not images:
        ids, types = prompt_ids(ref.tokenizer, prompt, None)
        return ids, types, None
    ids, types = prompt_ids(ref.tokenizer, prompt, image_rows(ref.config))
    return ids, types, preprocess(images[0], ref.config.vision_config["image_size"])


def reference_greedy(
    model_dir: str,
    prompt: str,
    images: list[Image.Image] | None,
    n: int,
    device: str = "cpu",
) -> tuple[list[int], list[int], torch.Tensor]:
    """(prompt ids, n greedy new ids, [n, V] float32 log-softmax of each step's logits) as ``hf_greedy`` returns
    them; every EOS id of generation_config.json is -inf before the log-softmax and the argmax (min_new_tokens)."""
    ref = load_reference(str(model_dir), device)
    ids, types, pixels = reference_prompt(ref, prompt, images)
    seq, seq_types, new, steps = list(ids), list(types), [], []
    with torch.no_grad():
        for _ in range(n):
            logits = ref.logits(seq, seq_types, pixels)[-1].float()
            logits[list(ref.eos_ids)] = float("-inf")
            logprobs = torch.log_softmax(logits, dim=-1)
            token = int(torch.argmax(logprobs))
            steps.append(logprobs.cpu())
            new.append(token)
            seq.append(token)
            seq_types.append(LANGUAGE_TOKEN_TYPE)  # decode rows are language rows
    vocab = ref.config.vocab_size
    return ids, new, torch.stack(steps) if steps else torch.empty(0, vocab)
