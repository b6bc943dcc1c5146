"""LoRA adapters (PEFT format) served beside the base model: loading and resolving them onto our layers
(`adapter.py`), and the engine's registry that applies each request's adapter to its rows of a step (`manager.py`)."""

from mmserve.lora.adapter import LoRAAdapter
from mmserve.lora.manager import LoRAManager

__all__ = ["LoRAAdapter", "LoRAManager"]
