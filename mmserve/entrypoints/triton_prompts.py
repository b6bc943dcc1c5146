"""Prompt building of the Triton preprocessing model, per model type (PROTOCOL §6).

`ensemble` and `tensorrt_llm_bls` wrap the client's `text_input` in the family's pre/post prompt and put the
image placeholders where TensorRT-LLM puts the fake prompt ids; the checkpoint's own model name takes the
text as the full prompt and only adds placeholders the text lacks.
"""

from __future__ import annotations

from dataclasses import dataclass

_VILA_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. The assistant gives "
    "helpful, detailed, and polite answers to the user's questions. USER: "
)


@dataclass(frozen=True)
class PromptFormat:
    image_token: (
        str | None
    )  # placeholder the HF processor expands; None: images are implicit (blip2)
    pre_prompt: str = ""
    post_prompt: str = ""
    image_sep: str = ""  # between the image placeholders and the text when placeholders are added
    prepend_images: bool = (
        False  # placeholders go before the pre-prompt (blip2, mllama: text starts with them)
    )
    video_token: str | None = None  # None: the family takes no video


# Keyed by HF config.model_type (and the seeds' --model_type spelling where it differs).
FORMATS: dict[str, PromptFormat] = {
    "blip2": PromptFormat(image_token=None),
    "fuyu": PromptFormat(
        image_token=None
    ),  # its processor lays the picture's patch rows out before the text
    "kosmos-2": PromptFormat(
        image_token=None
    ),  # its processor puts <image> and the image span first
    "vision-encoder-decoder": PromptFormat(
        image_token=None
    ),  # Nougat: the text (often empty) starts the answer
    "llava": PromptFormat("<image>", "USER:\n", " ASSISTANT:"),
    "vila": PromptFormat("<image>", _VILA_SYSTEM, " ASSISTANT:", image_sep="\n"),
    "llava_onevision": PromptFormat(
        "<image>",
        "<|im_start|>user ",
        "<|im_end|><|im_start|>assistant\n",
        image_sep="\n",
        video_token="<video>",
    ),
    "llava_next": PromptFormat(
        "<image>", "[INST] ", " [/INST]", image_sep="\n"
    ),  # the Mistral-based v1.6
    "mllama": PromptFormat("<|image|>", prepend_images=True),
    "qwen2_vl": PromptFormat(
        "<|vision_start|><|image_pad|><|vision_end|>",
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n",
        "<|im_end|>\n<|im_start|>assistant\n",
        video_token="<|vision_start|><|video_pad|><|vision_end|>",
    ),
    "pixtral": PromptFormat("[IMG]"),
}
FORMATS["blip-2"] = FORMATS["blip2"]
FORMATS["llava_llama"] = FORMATS["vila"]  # VILA checkpoints' HF model_type
FORMATS["nougat"] = FORMATS["vision-encoder-decoder"]
FORMATS["pix2struct"] = FORMATS[
    "vision-encoder-decoder"
]  # Deplot: the text is the question drawn on the picture


def model_type_of(hf_config) -> str:
    """The prompt-format key of a checkpoint: its config.model_type, except where one model_type covers families
    that prompt differently (a LLaVA config with Pixtral's tower is `pixtral`, as TensorRT-LLM's --model_type)."""
    vision = getattr(getattr(hf_config, "vision_config", None), "model_type", "")
    return (
        "pixtral"
        if hf_config.model_type == "llava" and vision == "pixtral"
        else hf_config.model_type
    )


def format_for(
    model_type: str, image_token: str | None = "<image>", video_token: str | None = None
) -> PromptFormat:
    """The family's format; an unknown family gets no pre/post prompt and its processor's placeholders."""
    return FORMATS.get(model_type) or PromptFormat(image_token, video_token=video_token)


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
