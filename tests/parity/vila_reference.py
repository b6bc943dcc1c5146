"""An eager VILA 1.5 reference, the oracle of the VILA parity tests (transformers has no VILA class).

Built on transformers' own blocks (`SiglipVisionModel`, `LlamaForCausalLM`) and following NVlabs/VILA
(github.com/NVlabs/VILA at e63f898, the VILA 1.5 era) piece by piece:

- the prompt's ids: `llava/mm_utils.py: tokenizer_image_token` (each `<image>`-cut chunk tokenized with BOS, the
  later chunks' BOS dropped, IMAGE_TOKEN_INDEX between them);
- the pictures: `llava/mm_utils.py: process_image` ("resize": PIL `resize` to the processor's square, then the
  image processor; "pad": `expand2square` with the mean colour);
- the tower's features: `llava/model/multimodal_encoder/vision_encoder.py: VisionTower.feature_select`
  (`hidden_states[mm_vision_select_layer]`; "patch" drops the first position, "cls_patch" keeps all);
- the projector: `llava/model/multimodal_projector/base_projector.py: DownSampleBlock.flat_square` and the
  `mlp_downsample` `nn.Sequential(DownSampleBlock(), LayerNorm, Linear, GELU, Linear)`;
- splicing: `llava/model/llava_arch.py: prepare_inputs_labels_for_multimodal` (each IMAGE_TOKEN_INDEX replaced by
  its picture's features, positions 0..P-1).

The prompt ids it returns carry mmserve's stand-in id (`models/vila.py: PLACEHOLDER_ID`) at each picture's
tokens, as the engine reports them; everything else here is independent of mmserve's code.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
from PIL import Image
from safetensors.torch import load_file
from torch import nn

IMAGE_TOKEN_INDEX = -200
PLACEHOLDER_ID = 0  # mmserve's prompt id at picture tokens


def tokenizer_image_token(prompt: str, tokenizer) -> list[int]:
    chunks = [tokenizer(chunk).input_ids for chunk in prompt.split("<image>")]
    ids: list[int] = []
    offset = 0
    if chunks and chunks[0] and chunks[0][0] == tokenizer.bos_token_id:
        offset = 1
        ids.append(chunks[0][0])
    for k, chunk in enumerate(chunks):
        if k:
            ids.append(IMAGE_TOKEN_INDEX)
        ids.extend(chunk[offset:])
    return ids


def process_image(image: Image.Image, processor, aspect: str, device: str = "cpu") -> torch.Tensor:
    image = image.convert("RGB")
    if aspect == "resize":
        side = processor.size["height"]
        image = image.resize((side, side))
    else:  # expand2square
        w, h = image.size
        if w != h:
            fill = tuple(int(x * 255) for x in processor.image_mean)
            square = Image.new(image.mode, (max(w, h), max(w, h)), fill)
            square.paste(image, ((max(w, h) - w) // 2, (max(w, h) - h) // 2))
            image = square
    # on a GPU the engine resizes and normalises there: so does the oracle, to compare models, not interpolations
    kw = {"device": device} if device != "cpu" else {}
    return processor(image, return_tensors="pt", **kw)["pixel_values"][0]


def flat_square(x: torch.Tensor) -> torch.Tensor:
    n, w, h, c = x.size()
    if w % 2 == 1:
        x = torch.cat([x, torch.zeros((n, 1, h, c), dtype=x.dtype, device=x.device)], dim=1)
        n, w, h, c = x.size()
    if h % 2 == 1:
        x = torch.cat([x, torch.zeros((n, w, 1, c), dtype=x.dtype, device=x.device)], dim=2)
        n, w, h, c = x.size()
    x = x.view(n, w, h // 2, c * 2).permute(0, 2, 1, 3).contiguous()
    return x.view(n, h // 2, w // 2, c * 4)


class DownSampleBlock(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        side = int(x.shape[1] ** 0.5)
        x = flat_square(x.reshape(x.shape[0], side, side, -1))
        return x.reshape(x.shape[0], -1, x.shape[-1])


class VilaReference(nn.Module):
    def __init__(self, model_dir: str) -> None:
        super().__init__()
        from transformers import (
            AutoImageProcessor,
            AutoTokenizer,
            LlamaForCausalLM,
            SiglipVisionModel,
        )

        root = Path(model_dir)
        self.top = json.loads((root / "config.json").read_text())
        kind = json.loads((root / "mm_projector" / "config.json").read_text())["mm_projector_type"]
        assert kind == "mlp_downsample", kind
        self.tokenizer = AutoTokenizer.from_pretrained(root / "llm")
        self.processor = AutoImageProcessor.from_pretrained(root / "vision_tower")
        self.tower = SiglipVisionModel.from_pretrained(root / "vision_tower", dtype=torch.float32)
        self.llm = LlamaForCausalLM.from_pretrained(root / "llm", dtype=torch.float32)
        c, h = self.tower.config.hidden_size, self.llm.config.hidden_size
        self.projector = nn.Sequential(
            DownSampleBlock(), nn.LayerNorm(4 * c), nn.Linear(4 * c, h), nn.GELU(), nn.Linear(h, h)
        )
        self.projector.load_state_dict(
            {
                k.removeprefix("layers."): v.float()
                for k, v in load_file(root / "mm_projector" / "model.safetensors").items()
            }
        )

    def image_features(self, pixels: torch.Tensor) -> torch.Tensor:
        out = self.tower(pixel_values=pixels, output_hidden_states=True)
        feats = out.hidden_states[self.top["mm_vision_select_layer"]]
        if self.top["mm_vision_select_feature"] == "patch":
            feats = feats[:, 1:]
        return self.projector(feats)

    def embeds(self, ids: list[int], feats: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """(inputs_embeds [1, P, H], mmserve-style prompt ids) with each IMAGE_TOKEN_INDEX spliced out."""
        embed = self.llm.get_input_embeddings()
        parts, prompt_ids, k = [], [], 0
        for tok in ids:
            if tok == IMAGE_TOKEN_INDEX:
                parts.append(feats[k])
                prompt_ids += [PLACEHOLDER_ID] * len(feats[k])
                k += 1
            else:
                parts.append(embed(torch.tensor([tok], device=feats.device)))
                prompt_ids.append(tok)
        return torch.cat(parts)[None], prompt_ids


@functools.lru_cache(maxsize=2)
def _load(model_dir: str, device: str) -> VilaReference:
    return VilaReference(model_dir).to(device).eval()


def reference_greedy(
    model_dir: str, prompt: str, images: list[Image.Image] | None, n: int, device: str = "cpu"
) -> tuple[list[int], list[int], torch.Tensor]:
    """(prompt ids, n greedy ids, [n, V] log-softmax per step with EOS masked, as HF's min_new_tokens)."""
    ref = _load(model_dir, device)
    images = images or []
    ids = tokenizer_image_token(prompt, ref.tokenizer)
    with torch.no_grad():
        feats = torch.zeros(0, 0, ref.llm.config.hidden_size, device=device)
        if images:
            aspect = ref.top.get("image_aspect_ratio", "resize")
            pixels = torch.stack(
                [process_image(im, ref.processor, aspect, device) for im in images]
            )
            feats = ref.image_features(pixels.to(device))
        embeds, prompt_ids = ref.embeds(ids, feats)
        eos = ref.llm.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos]
        new, steps = [], []
        for _ in range(n):
            logits = ref.llm(inputs_embeds=embeds).logits[0, -1].float()
            logits[eos] = float("-inf")
            logprobs = torch.log_softmax(logits, dim=-1)
            tok = int(logprobs.argmax())
            new.append(tok)
            steps.append(logprobs.cpu())
            next_embed = ref.llm.get_input_embeddings()(torch.tensor([[tok]], device=device))
            embeds = torch.cat([embeds, next_embed], dim=1)
    return prompt_ids, new, torch.stack(steps)
