"""InternLM-XComposer2 (`internlm/internlm-xcomposer2-vl-7b`): a CLIP ViT-L/14 tower at 490 px, an MLP projector and an
InternLM2 decoder whose linear layers carry a **Partial LoRA** (`Plora_A` / `Plora_B`) applied to picture tokens only,
read from the published checkpoint (`.bin` shards, remote code not run).

InternLM2 is a Llama with other names and a packed `wqkv` whose rows are, per key/value head, that head's queries,
its key, its value (`modeling_internlm2.py`); they are de-interleaved into our fused q/k/v at load. The Partial LoRA
(`build_mlp.py: PLoRA`, r = alpha = 256: unscaled) becomes a built-in LoRA adapter (`builtin_lora`) that the runner
applies to a step's picture rows (spec `media_lora`); a request that brings its own adapter (the seed's
`lora_task_id` + `lora_weights` + `lora_config`, the Partial LoRA sent the TensorRT-LLM way) has that one applied to
its picture rows instead. The prompt is cut at `<ImageHere>`, each text part tokenized with BOS
(`interleav_wrap_chat`), each picture's 1,225 rows the unk id; pictures: bicubic resize to the square, CLIP
normalisation (`vis_processor`). The tower's last layer (before the post-norm), CLS dropped, feeds the projector.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mmserve.core.multimodal import MultiModalItem
from mmserve.layers.activation import get_act_fn
from mmserve.layers.linear import ReplicatedLinear
from mmserve.lora.adapter import LoRAAdapter, LoRATarget
from mmserve.models.base import MultiModalCausalLM
from mmserve.models.clip import CLIPVisionTower
from mmserve.models.family import FamilySpec, PromptFormat
from mmserve.models.llama import LlamaForCausalLM
from mmserve.models.registry import register_family
from mmserve.models.split_prompt import SplitPromptProcessor, SquarePictures
from mmserve.models.weights import load_weights, split_grouped_qkv

IMAGE_TAG = "<ImageHere>"
BUILTIN_LORA = "partial-lora"
# build_mlp.py loads openai/clip-vit-large-patch14-336 and resizes only its position table
VIT_L14 = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, patch_size=14)
VIT_L14.update(num_attention_heads=16, hidden_act="quick_gelu", layer_norm_eps=1e-5)
# the original chat(): its meta instruction as the seeds' client sends it, InternLM2's turns, pictures first
CHAT_TEMPLATE = (
    "{{- '[UNUSED_TOKEN_146]system\\nYou are an AI assistant whose name is InternLM-XComposer (浦语·灵笔)."
    "[UNUSED_TOKEN_145]\\n' -}}"
    "{%- for message in messages if message['role'] != 'system' -%}"
    "{{- '[UNUSED_TOKEN_146]' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}{%- else -%}"
    "{%- for part in message['content'] if part['type'] == 'image' -%}{{- '<ImageHere>' -}}{%- endfor -%}"
    "{%- for part in message['content'] if part['type'] == 'text' -%}{{- part['text'] -}}{%- endfor -%}"
    "{%- endif -%}{{- '[UNUSED_TOKEN_145]\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '[UNUSED_TOKEN_146]assistant\\n' -}}{%- endif -%}"
)
# InternLM2 module → ours (Partial LoRA: the same module's delta)
RENAMES = {
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def iter_bin_shards(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of `pytorch_model*.bin` shards (by their index when there is one), memory-mapped."""
    root = Path(model_dir)
    index = root / "pytorch_model.bin.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in root.glob("pytorch_model*.bin"))
    if not files:
        raise FileNotFoundError(f"no pytorch_model*.bin weights in {model_dir}")
    for name in files:
        yield from torch.load(root / name, map_location="cpu", weights_only=True, mmap=True).items()


@register_family(
    FamilySpec(
        name="internlm_xcomposer2",
        architectures=("InternLMXComposer2ForCausalLM",),
        model_types=("internlmxcomposer2", "internlm_xcomposer2"),
        prompt=PromptFormat(IMAGE_TAG),
        media_rows="span",
        media_lora=True,
        encoder_cuda_graphs=True,
    )
)
class InternLMXComposer2ForCausalLM(MultiModalCausalLM):
    weight_renames = [
        ("vit.vision_tower.vision_model.", "vision_tower."),
        ("vision_proj.0.", "vision_proj.linear_1."),
        ("vision_proj.2.", "vision_proj.linear_2."),
        ("model.tok_embeddings.", "language_model.model.embed_tokens."),
        ("model.", "language_model.model."),
        ("output.", "language_model.lm_head."),
    ]

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        text = config.text_config
        self.vision_tower = CLIPVisionTower(config.vision_config)
        self.vision_proj = nn.Module()
        self.vision_proj.linear_1 = ReplicatedLinear(
            config.vision_config.hidden_size, text.hidden_size, bias=True
        )
        self.vision_proj.act = get_act_fn("gelu")
        self.vision_proj.linear_2 = ReplicatedLinear(text.hidden_size, text.hidden_size, bias=True)
        self.language_model = LlamaForCausalLM(text)

    @classmethod
    def load_config(cls, model_dir: str) -> Any:
        from transformers import CLIPVisionConfig, LlamaConfig, PretrainedConfig

        fields = json.loads((Path(model_dir) / "config.json").read_text())
        if fields.get("rope_scaling"):
            raise ValueError(
                f"InternLM-XComposer2 rope_scaling {fields['rope_scaling']!r} is not supported"
            )
        dtype = fields.get("torch_dtype") or "float16"
        keys = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "rms_norm_eps",
        )
        text = LlamaConfig(
            **{k: fields[k] for k in keys},
            num_attention_heads=fields["num_attention_heads"],
            num_key_value_heads=fields.get("num_key_value_heads") or fields["num_attention_heads"],
            max_position_embeddings=fields.get("max_position_embeddings", 32768),
            bos_token_id=fields.get("bos_token_id"),
            eos_token_id=fields.get("eos_token_id"),
            pad_token_id=fields.get("pad_token_id"),
            rope_parameters={"rope_type": "default", "rope_theta": fields.get("rope_theta", 1e6)},
            tie_word_embeddings=False,
        )
        text.dtype = dtype
        vision = CLIPVisionConfig(
            **(fields.get("vision_config") or VIT_L14), image_size=fields["img_size"]
        )
        config = PretrainedConfig(
            architectures=fields["architectures"], img_size=fields["img_size"]
        )
        config.text_config, config.vision_config, config.dtype = text, vision, dtype
        return config

    @classmethod
    def checkpoint_weights(cls, model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
        return iter_bin_shards(model_dir)

    @classmethod
    def build_processor(cls, model_dir: str, hf_config: Any) -> SplitPromptProcessor:
        # the tokenizer files alone: AutoTokenizer would follow config.json's auto_map to remote code
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
        v = hf_config.vision_config
        rows = (v.image_size // v.patch_size) ** 2
        return SplitPromptProcessor(
            tokenizer,
            SquarePictures(v.image_size),
            IMAGE_TAG,
            rows,
            tokenizer.unk_token_id,
            special_tokens=True,
            chat_template=tokenizer.chat_template or CHAT_TEMPLATE,
        )

    @classmethod
    def build_mm_items(
        cls, hf_config, enc, ids: list[int], image_keys: list[str], video_keys: list[str]
    ) -> list[MultiModalItem]:
        if video_keys:
            raise ValueError("this model does not take video input")
        return [
            MultiModalItem("image", {"pixel_values": enc["pixel_values"][k]}, off, n, image_keys[k])
            for k, (off, n) in enumerate(enc["image_spans"])
        ]

    def get_mm_embeddings(self, items: list[MultiModalItem]) -> list[torch.Tensor]:
        (states,) = self.vision_tower(torch.stack([it.data["pixel_values"] for it in items]), [-1])
        p = self.vision_proj
        return list(p.linear_2(p.act(p.linear_1(states[:, 1:]))))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        plora: dict[str, dict[str, torch.Tensor]] = {}

        def llama_names() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if ".Plora_" in name:  # model.layers.N.<module>.Plora_A.weight
                    module, _, kind = name.partition(".Plora_")
                    plora.setdefault(module, {})[kind[0]] = tensor
                    continue
                yield from self._renamed(name, tensor)

        load_weights(
            self,
            llama_names(),
            self.weight_renames,
            LlamaForCausalLM.packed_modules,
            ignore=("position_ids", "rotary_emb.inv_freq"),
        )
        if plora:
            self.builtin_lora = self._partial_lora(plora)

    def _renamed(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """InternLM2's names as Llama's; its packed wqkv as q_proj / k_proj / v_proj."""
        if ".attention.wqkv." in name:
            stem = name.replace(".attention.wqkv.", ".self_attn.")
            for part, piece in zip(("q_proj.", "k_proj.", "v_proj."), self._split_wqkv(tensor)):
                yield stem.replace(".self_attn.", f".self_attn.{part}"), piece
            return
        for old, new in RENAMES.items():
            if f".{old}." in name:
                name = name.replace(f".{old}.", f".{new}.")
                break
        yield name, tensor

    def _split_wqkv(self, packed: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rows [kv_heads, queries per kv head + 2, head_dim, ...] → (q, k, v)."""
        text = self.config.text_config
        hd = text.hidden_size // text.num_attention_heads
        return split_grouped_qkv(packed, text.num_key_value_heads, hd)

    def _partial_lora(self, plora: dict[str, dict[str, torch.Tensor]]) -> LoRAAdapter:
        """The checkpoint's Partial LoRA as an adapter of this rank's shards (unscaled: r = alpha)."""
        device, dtype = (
            self.language_model.lm_head.weight.device,
            self.language_model.lm_head.weight.dtype,
        )
        packed = LlamaForCausalLM.packed_modules
        adapter = LoRAAdapter(
            BUILTIN_LORA, BUILTIN_LORA, 0
        )  # no request names it: no prefix-cache salt
        for module, ab in sorted(plora.items()):
            a, b = ab["A"].float(), ab["B"].float()
            adapter.rank = len(a)
            if module.endswith(".attention.wqkv"):
                stem = module.replace(".attention.wqkv", ".self_attn.")
                parts = [
                    (stem + p, piece)
                    for p, piece in zip(("q_proj", "k_proj", "v_proj"), self._split_wqkv(b))
                ]
            else:
                ((name, _),) = self._renamed(module + ".weight", b)
                parts = [(name.removesuffix(".weight"), b)]
            for ckpt, part_b in parts:
                ours = "language_model." + ckpt
                shard = None
                for piece, (fused, shard_id) in packed.items():
                    if piece.strip(".") == ours.rsplit(".", 1)[-1]:
                        ours, shard = ours.rsplit(".", 1)[0] + fused.rstrip("."), shard_id
                        break
                offset, size, sa, sb = self.get_submodule(ours).lora_shard(shard, len(a), a, part_b)
                target = LoRATarget(offset, size, sa.to(device, dtype), sb.to(device, dtype))
                adapter.targets.setdefault(ours, []).append(target)
        return adapter
