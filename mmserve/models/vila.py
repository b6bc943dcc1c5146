"""VILA (NVlabs, HF model_type `llava_llama`): the seeds' prompt and client formats.

Declared so the Triton `ensemble` prompt and `mmserve client --model_type vila` follow the seeds; no class of
ours loads VILA checkpoints yet (its spec names no architecture), so serving one fails with the list of
supported architectures.
"""

from __future__ import annotations

from mmserve.models.family import ClientFormat, FamilySpec, PromptFormat
from mmserve.models.registry import declare_family

_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. The assistant gives "
    "helpful, detailed, and polite answers to the user's questions. USER: "
)

VILA = declare_family(
    FamilySpec(
        name="vila",
        model_types=("vila", "llava_llama"),
        prompt=PromptFormat("<image>", _SYSTEM, " ASSISTANT:", image_sep="\n"),
        client=ClientFormat("vila", preprocessed=True, video=False),
    )
)
