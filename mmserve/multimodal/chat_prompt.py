"""OpenAI-style chat messages -> a prompt dict for InputProcessor.process, through the checkpoint's chat
template (or, for an encoder-decoder without one, its single user turn)."""

from __future__ import annotations

from typing import Any

# chat content part type -> (the HF chat template's part type, prompt dict key)
MEDIA_PARTS = {
    "image_url": ("image", "images"),
    "image": ("image", "images"),
    "video_url": ("video", "videos"),
    "video": ("video", "videos"),
}


def chat_prompt(
    messages: list[dict], processor: Any, tokenizer: Any, encoder_decoder: bool
) -> dict[str, Any]:
    """OpenAI-style messages -> a prompt dict {"prompt", "images", "videos"} for process().

    Content parts: text, image_url / image, video_url / video (URL, data URI, path, bytes or decoded
    frames), in order; the checkpoint's chat template (of `processor`, else of `tokenizer`) places their
    placeholders. An encoder-decoder without a chat template takes one user message: its text is the prompt,
    its picture the image.
    """
    hf_messages: list[dict] = []
    media: dict[str, list[Any]] = {"images": [], "videos": []}
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"messages[{i}] needs a 'role'")
        content = m.get("content", "")
        if isinstance(content, str):
            hf_messages.append({"role": m["role"], "content": [{"type": "text", "text": content}]})
            continue
        parts = []
        for part in content:
            kind = part.get("type")
            if kind == "text":
                parts.append({"type": "text", "text": part.get("text", "")})
            elif kind in MEDIA_PARTS:
                modality, key = MEDIA_PARTS[kind]
                src = part.get(kind)
                media[key].append(src["url"] if isinstance(src, dict) else src)
                parts.append({"type": modality})
            else:
                raise ValueError(f"messages[{i}]: unsupported content part type {kind!r}")
        hf_messages.append({"role": m["role"], "content": parts})
    # some processors drop the template their tokenizer carries (Fuyu's): use the tokenizer's then
    owner = processor if getattr(processor, "chat_template", None) else tokenizer
    if not getattr(owner, "chat_template", None) and encoder_decoder:
        # encoder-decoders (Deplot, Nougat, BLIP-2 T5) have no chat format: one user turn is the prompt
        if len(hf_messages) != 1 or hf_messages[0]["role"] != "user":
            raise ValueError(
                "messages: this model takes one user message (its text and picture), got roles "
                f"{[m['role'] for m in hf_messages]}"
            )
        text = "\n".join(p["text"] for p in hf_messages[0]["content"] if p["type"] == "text")
        return {"prompt": text, **{k: v for k, v in media.items() if v}}
    if not getattr(owner, "chat_template", None):
        raise ValueError(
            "this model has no chat template: send a plain prompt (e.g. /v1/completions)"
        )
    prompt = owner.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False)
    return {"prompt": prompt, **{k: v for k, v in media.items() if v}}
