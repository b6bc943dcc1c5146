"""The `transformers` baseline: `generate` of the checkpoint's own architecture (`config.architectures[0]`,
e.g. `LlavaForConditionalGeneration`, `Qwen2VLForConditionalGeneration`, `Blip2ForConditionalGeneration`;
default attention, greedy, left-padded batches) on the same checkpoint, prompts, images and dtype as
mmserve, timed with device syncs.

Every timing starts before the HF processor call, as mmserve's start before `add_request` (which
preprocesses), so both include image preprocessing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers.generation.streamers import BaseStreamer

from mmserve.bench.workload import free_device_memory, now, sync, torch_dtype


@dataclass
class HFTiming:
    """One `generate` call over a batch."""

    batch_size: int
    prompt_tokens: int  # per sequence, image placeholders included (after left padding)
    new_tokens: int  # per sequence
    total_s: float  # processor + generate, synced
    first_token_s: float | None = None  # from the start until the first new token (when streamed)
    token_times_s: list[float] = field(
        default_factory=list
    )  # since start, one per new token (when streamed)


class _TokenClock(BaseStreamer):
    """A generate() streamer that only timestamps: the first put() is the prompt, each later one a new token."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(now())

    def end(self) -> None:
        pass


def model_class(model_dir: str) -> Any:
    """The transformers class named by the checkpoint's `config.architectures[0]` (else the image-text Auto class)."""
    import transformers

    archs = transformers.AutoConfig.from_pretrained(model_dir).architectures or []
    if archs and hasattr(transformers, archs[0]):
        return getattr(transformers, archs[0])
    return transformers.AutoModelForImageTextToText


class HFBaseline:
    """A loaded transformers vision-language model and its processor on one device."""

    def __init__(
        self, model_dir: str, device: str, dtype: str, attn_implementation: str | None = None
    ) -> None:
        import torch
        from transformers import AutoProcessor

        self.device = device
        kwargs: dict[str, Any] = {"dtype": torch_dtype(dtype)}
        if attn_implementation:
            kwargs["attn_implementation"] = attn_implementation
        self.model = model_class(model_dir).from_pretrained(model_dir, **kwargs).to(device).eval()
        self.processor = AutoProcessor.from_pretrained(model_dir)
        self.processor.tokenizer.padding_side = "left"
        tok = self.processor.tokenizer
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.attn_implementation = getattr(self.model.config, "_attn_implementation", None)
        from mmserve.models.registry import get_model_class

        self.ours = get_model_class(self.model.config)  # our class: the family's processor route
        self.model_dir = model_dir
        self._torch = torch

    def _encode(self, prompts: list[str], images: list[Any]) -> Any:
        if getattr(self.model.config, "is_vqa", False):
            # a VQA checkpoint (Deplot): each question drawn on its picture, as mmserve draws it (same route, font)
            extra = self.ours.processor_kwargs(self.model_dir, self.model.config, None)
            parts = [
                self.ours.call_processor(self.processor, p, {"images": [image], **extra})
                for p, image in zip(prompts, images)
            ]
            enc = {
                k: self._torch.cat([part[k] for part in parts])
                for k in ("flattened_patches", "attention_mask")
            }
            enc["flattened_patches"] = enc["flattened_patches"].to(self.model.dtype)
            enc["decoder_input_ids"] = self._torch.tensor(
                [[self.model.config.decoder_start_token_id]] * len(prompts)
            )
            return {k: v.to(self.device) for k, v in enc.items()}
        if getattr(self.model.config, "is_encoder_decoder", False):
            # an encoder-decoder (Nougat): the processor reads the pictures; the text starts the decoder's answer
            enc = dict(self.processor(images=images, return_tensors="pt"))
            start = self.model.config.decoder_start_token_id
            ids = [
                [start] + self.processor.tokenizer(p, add_special_tokens=False).input_ids
                if p
                else [start]
                for p in prompts
            ]
            if len({len(i) for i in ids}) != 1:
                raise ValueError("an encoder-decoder bench batch needs prompts of one length")
            enc["decoder_input_ids"] = self._torch.tensor(ids)
            return {k: v.to(self.device) for k, v in enc.items()}
        if self.ours.family.images_per_prompt_lists:
            images = [[image] for image in images]
        enc = self.processor(text=prompts, images=images, padding=True, return_tensors="pt")
        return enc.to(self.device)

    def generate(
        self,
        prompts: list[str],
        images: list[Any],
        new_tokens: int,
        stream: bool = False,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
    ) -> HFTiming:
        """`generate(max_new_tokens=min_new_tokens=new_tokens)` of one left-padded batch: greedy, or sampling
        when temperature > 0 (top_k 0 = off: transformers' own default would be 50)."""
        sampling = (
            dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k)
            if temperature > 0
            else dict(do_sample=False)
        )
        clock = _TokenClock() if stream else None
        sync(self.device)
        t0 = now()
        enc = self._encode(prompts, images)
        with self._torch.inference_mode():
            out = self.model.generate(
                **enc,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                **sampling,
                pad_token_id=self.pad_id,
                streamer=clock,
                forced_eos_token_id=None,
            )
        sync(self.device)
        total = now() - t0
        prompt_len = int(
            enc["decoder_input_ids" if "decoder_input_ids" in enc else "input_ids"].shape[1]
        )
        got = int(out.shape[1]) - prompt_len
        if got != new_tokens:
            raise RuntimeError(f"transformers generated {got} tokens, expected {new_tokens}")
        timing = HFTiming(len(prompts), prompt_len, got, total)
        if clock is not None and len(clock.times) > 1:
            timing.token_times_s = [t - t0 for t in clock.times[1:]]
            timing.first_token_s = timing.token_times_s[0]
        return timing

    def close(self) -> None:
        """Drop the model and give its device memory back (mmserve may run next in this process)."""
        del self.model
        free_device_memory(self.device)
