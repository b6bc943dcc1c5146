"""The encoder-decoder route of a prompt, as the model class's spec (`model_cls.family`) and methods declare it:
the decoder prompt's checks and ids, and the encoder's inputs from the HF processor (with the text, or the
picture only)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def checked_decoder_prompt(decoder_prompt: Any, model_cls: type) -> str:
    """A prompt dict's decoder_prompt ("" when absent); only encoder-decoder models take one."""
    decoder_prompt = decoder_prompt or ""
    if not isinstance(decoder_prompt, str):
        raise TypeError(f"decoder_prompt must be a string, got {type(decoder_prompt).__name__}")
    if decoder_prompt and not model_cls.family.encoder_decoder:
        raise ValueError(
            "decoder_prompt: only encoder-decoder models have a decoder prompt; put the text in the "
            "prompt"
        )
    return decoder_prompt


def decoder_ids(
    model_cls: type, hf_config: Any, tokenizer: Any, text: str, decoder_prompt: str
) -> list[int]:
    """An encoder-decoder's decoder prompt: the family's start (with the text, for families whose prompt is the
    decoder's), then decoder_prompt's tokens."""
    ids = model_cls.decoder_prompt_ids(hf_config, tokenizer, text)
    if not decoder_prompt:
        return ids
    if not model_cls.family.encoder_reads_text and text.strip():
        raise ValueError(
            "decoder_prompt: this model's prompt already is the decoder's; give the answer's start "
            "in one of them"
        )
    return ids + tokenizer(decoder_prompt, add_special_tokens=False).input_ids


def encoder_outputs(
    model_cls: type,
    processor: Any,
    text: str,
    kwargs: dict[str, Any],
    run: Callable[[Callable[[], Any]], Any],
    image_outputs: Callable[[], dict[str, Any]],
) -> dict[str, Any]:
    """The encoder's inputs for text + picture: the model class's processor call (run through `run`, with the
    processor's ids as the encoder's) where the encoder reads the text, else the image processor's outputs
    (`image_outputs()`) only."""
    if model_cls.family.encoder_reads_text:  # the processor's ids are the encoder's
        call = model_cls.call_processor
        enc = dict(run(lambda: call(processor, text, kwargs)))
        if "input_ids" in enc:
            enc["encoder_input_ids"] = enc["input_ids"]
        enc["encoder_text"] = text
        return enc
    return dict(image_outputs())  # Nougat: the processor sees only the picture
