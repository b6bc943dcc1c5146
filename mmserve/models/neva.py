"""NeVA (NVIDIA NeMo): a `.nemo` archive (model_config.yaml, Megatron-core weights, tokenizer) served as it is, without
NeMo, with its vision tower in the HF folder the yaml names (`mm_cfg.vision_encoder.from_pretrained`, found beside
the `.nemo` as TensorRT-LLM's `build_neva_engine` finds it). Serve the directory that holds both.

The picture: the tower's layer `vision_select_layer`, its first `class_token_length` outputs dropped, through the
`mlp2x_gelu` projector (NeMo `neva_model.py: NevaWordEmbeddingMixin.encode_vision_x`); resized straight to the
square and normalised with the tower's mean / std (the seeds' run.py transform). The prompt (TensorRT-LLM's NeVA
runner): the text cut at `<image>`, each part tokenized alone without BOS (`sp.encode`), each picture
`data.image_token_len` rows of `<extra_id_3>` (NeMo's image patch token) that its features replace; the seeds'
template `<extra_id_0>System\\n\\n<extra_id_1>User\\n<image>\\n{question}\\n<extra_id_1>Assistant\\n`. The decoder:
models/nemo_gpt.py.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mmserve.core.multimodal import MultiModalItem
from mmserve.layers.activation import get_act_fn
from mmserve.layers.linear import ReplicatedLinear
from mmserve.models.base import MultiModalCausalLM
from mmserve.models.clip import CLIPVisionTower
from mmserve.models.family import FamilySpec, PromptFormat
from mmserve.models.llama import LlamaForCausalLM
from mmserve.models.nemo_archive import (
    iter_nemo_weights,
    nemo_file,
    nemo_tokenizer_file,
    read_nemo_config,
    vision_tower_dir,
)
from mmserve.models.nemo_gpt import GATED, NemoGPTModel
from mmserve.models.registry import register_family
from mmserve.models.siglip import SiglipVisionTower
from mmserve.models.split_prompt import SplitPromptProcessor, SquarePictures
from mmserve.models.weights import iter_safetensors, load_weights, split_grouped_qkv

PRE = "<extra_id_0>System\n\n<extra_id_1>User\n"
POST = "\n<extra_id_1>Assistant\n"
PLACEHOLDER = "<extra_id_3>"
PROJECTOR = "model.embedding.word_embeddings.adapter_layer.mm_projector_adapter.mm_projector."
CHAT_TEMPLATE = (
    "{{- '<extra_id_0>System\\n\\n' -}}"
    "{%- for message in messages if message['role'] != 'system' -%}"
    "{%- if message['role'] == 'user' -%}{{- '<extra_id_1>User\\n' -}}"
    "{%- for part in message['content'] if part['type'] == 'image' -%}{{- '<image>\\n' -}}{%- endfor -%}"
    "{%- for part in message['content'] if part['type'] == 'text' -%}{{- part['text'] -}}{%- endfor -%}"
    "{{- '\\n' -}}{%- else -%}{{- '<extra_id_1>Assistant\\n' -}}"
    "{%- for part in message['content'] if part['type'] == 'text' -%}{{- part['text'] -}}{%- endfor -%}"
    "{{- '\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<extra_id_1>Assistant\\n' -}}{%- endif -%}"
)
_TOWERS = {"siglip_vision_model": SiglipVisionTower, "clip_vision_model": CLIPVisionTower}


def _text_config(yaml: dict[str, Any], vocab: int) -> Any:
    from transformers import PretrainedConfig

    heads = yaml["num_attention_heads"]
    if yaml.get("position_embedding_type", "rope") != "rope":
        raise ValueError(
            "NeVA: only rotary position embeddings (position_embedding_type rope) are supported"
        )
    if yaml.get("seq_len_interpolation_factor"):
        raise ValueError("NeVA: seq_len_interpolation_factor is not supported")
    config = PretrainedConfig(
        model_type="nemo_gpt",
        vocab_size=vocab,
        hidden_size=yaml["hidden_size"],
        intermediate_size=yaml["ffn_hidden_size"],
        num_hidden_layers=yaml["num_layers"],
        num_attention_heads=heads,
        num_key_value_heads=yaml.get("num_query_groups") or heads,
        head_dim=yaml.get("kv_channels") or yaml["hidden_size"] // heads,
        max_position_embeddings=yaml.get("max_position_embeddings")
        or yaml.get("encoder_seq_length"),
        normalization=yaml.get("normalization", "layernorm"),
        layernorm_epsilon=float(yaml.get("layernorm_epsilon", 1e-5)),
        activation=yaml.get("activation", "gelu"),
        bias=bool(yaml.get("bias", True)),
        rotary_percentage=float(yaml.get("rotary_percentage", 1.0)),
        rope_parameters={
            "rope_type": "default",
            "rope_theta": float(yaml.get("rotary_base", 10000)),
        },
        tie_word_embeddings=bool(yaml.get("share_embeddings_and_output_weights", True)),
    )
    return config


@register_family(
    FamilySpec(
        name="neva",
        architectures=("NevaForCausalLM",),
        checkpoint_file="*.nemo",
        model_types=("neva",),
        prompt=PromptFormat("<image>", PRE, POST, image_sep="\n"),
        encoder_cuda_graphs=True,
    )
)
class NevaForCausalLM(MultiModalCausalLM):
    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        text, vision = config.text_config, config.vision_config
        self.vision_tower = _TOWERS[vision.model_type](vision)
        self.mm_projector = nn.Module()
        self.mm_projector.linear_1 = ReplicatedLinear(
            vision.hidden_size, text.hidden_size, bias=True
        )
        self.mm_projector.act = get_act_fn("gelu")
        self.mm_projector.linear_2 = ReplicatedLinear(text.hidden_size, text.hidden_size, bias=True)
        self.language_model = LlamaForCausalLM(text, backbone=NemoGPTModel(text))
        self.weight_renames = [
            ("model.embedding.word_embeddings.weight", "language_model.model.embed_tokens.weight"),
            (PROJECTOR + "0.", "mm_projector.linear_1."),
            (PROJECTOR + "2.", "mm_projector.linear_2."),
            ("model.decoder.final_layernorm.", "language_model.model.final_layernorm."),
            ("model.decoder.", "language_model.model."),
            ("model.output_layer.", "language_model.lm_head."),
            ("vision_tower.vision_model.", "vision_tower."),
            ("vision_tower.", "vision_tower."),
        ]

    @classmethod
    def load_config(cls, model_dir: str) -> Any:
        from transformers import AutoConfig, PretrainedConfig

        path = nemo_file(model_dir)
        yaml = read_nemo_config(path)
        tower = vision_tower_dir(path, yaml)
        mm = yaml["mm_cfg"]
        if mm.get("mm_mlp_adapter_type", "linear") != "mlp2x_gelu":
            raise ValueError(
                f"NeVA projector {mm.get('mm_mlp_adapter_type')!r} is not supported (mlp2x_gelu)"
            )
        tokenizer = cls._tokenizer(path)
        # Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by × the training TP size
        multiple = int(yaml.get("make_vocab_size_divisible_by", 128)) * int(
            yaml.get("tensor_model_parallel_size", 1)
        )
        vocab = -(-len(tokenizer) // multiple) * multiple
        vision = AutoConfig.from_pretrained(tower)
        if vision.model_type not in _TOWERS:
            raise ValueError(
                f"NeVA vision tower {vision.model_type!r} is not supported: {list(_TOWERS)}"
            )
        config = PretrainedConfig(architectures=["NevaForCausalLM"], model_type="neva")
        config.text_config, config.vision_config = _text_config(yaml, vocab), vision
        config.vision_select_layer = int(mm["vision_encoder"].get("vision_select_layer", -2))
        config.class_token_length = int(mm["vision_encoder"].get("class_token_length", 1))
        config.image_token_len = int(yaml["data"]["image_token_len"])
        config.dtype = {"bf16": "bfloat16", 16: "float16", "16": "float16"}.get(
            yaml.get("precision"), "float32"
        )
        config.text_config.dtype = config.dtype
        return config

    @staticmethod
    def _tokenizer(path: Path) -> Any:
        from transformers import PreTrainedTokenizerFast

        with tempfile.TemporaryDirectory() as tmp:
            file = nemo_tokenizer_file(path, tmp)
            if file.suffix != ".json":
                raise ValueError(
                    f"{path}: NeVA tokenizer {file.name}: only a tokenizers JSON is read here (a SentencePiece "
                    "model needs the sentencepiece package: convert it with transformers' LlamaTokenizerFast)"
                )
            return PreTrainedTokenizerFast(
                tokenizer_file=str(file),
                bos_token="<s>",
                eos_token="</s>",
                unk_token="<unk>",
                pad_token="<pad>",
            )

    @classmethod
    def checkpoint_weights(cls, model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
        path = nemo_file(model_dir)
        yield from iter_nemo_weights(path)
        for name, tensor in iter_safetensors(vision_tower_dir(path)):
            yield "vision_tower." + name, tensor

    @classmethod
    def build_processor(cls, model_dir: str, hf_config: Any) -> SplitPromptProcessor:
        tower = vision_tower_dir(nemo_file(model_dir))
        pre = json.loads((tower / "preprocessor_config.json").read_text())
        tokenizer = cls._tokenizer(nemo_file(model_dir))
        pictures = SquarePictures(
            hf_config.vision_config.image_size, pre["image_mean"], pre["image_std"]
        )
        return SplitPromptProcessor(
            tokenizer,
            pictures,
            "<image>",
            hf_config.image_token_len,
            tokenizer.convert_tokens_to_ids(PLACEHOLDER),
            special_tokens=False,
            chat_template=CHAT_TEMPLATE,
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
        pixels = torch.stack([it.data["pixel_values"] for it in items])
        (states,) = self.vision_tower(pixels, [self.config.vision_select_layer])
        p = self.mm_projector
        return list(p.linear_2(p.act(p.linear_1(states[:, self.config.class_token_length :]))))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_weights(
            self,
            self._megatron_names(weights),
            self.weight_renames,
            {
                "_qkv.q.": ("_qkv.", "q"),
                "_qkv.k.": ("_qkv.", "k"),
                "_qkv.v.": ("_qkv.", "v"),
                "_fc1.gate.": ("_fc1.", 0),
                "_fc1.up.": ("_fc1.", 1),
            },
            ignore=("_extra_state", "position_ids", "vision_model.head.", "vision_tower.head.")
            + (("model.output_layer.",) if self.config.text_config.tie_word_embeddings else ()),
        )

    def _megatron_names(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The fused input norms as the attention / MLP's own (`layer_norm_weight` → `layer_norm.weight`; a
        LayerNorm1P scale + 1), `linear_qkv` split per query group into q / k / v, a gated `linear_fc1` into
        gate / up."""
        text = self.config.text_config
        one_p = text.normalization == "layernorm1p"
        groups, hd = text.num_key_value_heads, text.head_dim
        for name, tensor in weights:
            decoder_norm = name.endswith("final_layernorm.weight") or ".layer_norm_weight" in name
            if one_p and name.startswith("model.decoder.") and decoder_norm:
                tensor = tensor + 1
            name = name.replace(".linear_qkv.layer_norm_", ".layer_norm.")
            name = name.replace(".linear_fc1.layer_norm_", ".layer_norm.")
            if ".linear_qkv." in name:
                for part, piece in zip("qkv", split_grouped_qkv(tensor, groups, hd)):
                    yield name.replace(".linear_qkv.", f".linear_qkv.{part}."), piece
            elif ".linear_fc1." in name and text.activation in GATED:
                gate, up = tensor.chunk(2, dim=0)
                yield name.replace(".linear_fc1.", ".linear_fc1.gate."), gate
                yield name.replace(".linear_fc1.", ".linear_fc1.up."), up
            else:
                yield name, tensor
