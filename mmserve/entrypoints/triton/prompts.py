"""Prompt building of the Triton preprocessing model, per model type (PROTOCOL §6).

`ensemble` and `tensorrt_llm_bls` wrap the client's `text_input` in the family's pre/post prompt and put the
image placeholders where TensorRT-LLM puts the fake prompt ids; the checkpoint's own model name takes the
text as the full prompt and only adds placeholders the text lacks.
"""

from __future__ import annotations

from mmserve.models.family import PromptFormat
from mmserve.models.registry import family_for_model_type


def format_for(
    model_type: str, image_token: str | None = "<image>", video_token: str | None = None
) -> PromptFormat:
    """The format of the family answering to `model_type` (its name, an HF config.model_type or a seeds'
    --model_type); a family without one gets no pre/post prompt and its processor's placeholders."""
    family = family_for_model_type(model_type)
    if family is not None and family.prompt is not None:
        return family.prompt
    return PromptFormat(image_token, video_token=video_token)


def _already_wrapped(text: str, fmt: PromptFormat) -> bool:
    """True when the client already sent the full template (pre and post prompt around the text)."""
    pre, post = fmt.pre_prompt.strip(), fmt.post_prompt.strip()
    return bool(pre or post) and text.lstrip().startswith(pre) and text.rstrip().endswith(post)


def build_prompt(
    model_type: str,
    text: str,
    num_images: int,
    *,
    num_videos: int = 0,
    wrap: bool = True,
    field: str = "text_input",
    image_token: str | None = "<image>",
    video_token: str | None = None,
) -> str:
    """The prompt string for the engine: placeholders in place, wrapped in the pre/post prompt.

    Placeholders already in `text` are used where they are (their count must match the images, as in the
    seeds' multi-image `<image>` splitting); otherwise one per image goes where the family puts images.
    `image_token`/`video_token` are the served processor's placeholders, used for families the table lacks.
    Raises ValueError naming `field` when the counts cannot match.
    """
    fmt = format_for(model_type, image_token, video_token)
    if num_videos and fmt.video_token is None:
        raise ValueError(
            f"video_bytes_input: video input is not supported by model type {model_type}"
        )
    if fmt.image_token is None:
        marked = ""
    else:
        found = text.count(fmt.image_token)
        if found and found != num_images:
            raise ValueError(
                f"{field}: the text has {found} {fmt.image_token} placeholder(s) but "
                f"{num_images} image(s) were given"
            )
        marked = "" if found else fmt.image_token * num_images
    if num_videos:
        marked += fmt.video_token * num_videos if fmt.video_token not in text else ""
    if marked and not fmt.prepend_images:
        marked += fmt.image_sep
    if not wrap:
        return marked + text
    if _already_wrapped(text, fmt):
        if fmt.prepend_images or not fmt.pre_prompt.strip():
            return marked + text
        cut = text.index(fmt.pre_prompt.strip()) + len(fmt.pre_prompt.strip())
        return text[:cut] + marked + text[cut:]
    if fmt.prepend_images:
        return marked + fmt.pre_prompt + text + fmt.post_prompt
    return fmt.pre_prompt + marked + text + fmt.post_prompt
