"""Where a checkpoint is: a local directory, or a Hugging Face hub model ID resolved to its snapshot in the hub
cache (downloaded there first unless `HF_HUB_OFFLINE=1`; `HF_TOKEN` for gated repos), as vLLM and TGI take them.

`CheckpointError` says in one line what is wrong: no such directory or model ID, a directory without a
config.json, or an architecture no family serves (with the supported ones).
"""

from __future__ import annotations

import os
import re

# the weights and everything the config, tokenizer and processors read; no .bin / .pt copies of the weights
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja", "*.TTF"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class CheckpointError(ValueError):
    """The model argument names no checkpoint mmserve can serve."""


def is_hub_id(model: str) -> bool:
    """`org/name` that is no local path."""
    return bool(_REPO_ID.match(model)) and not os.path.exists(model)


def resolve_checkpoint(
    model: str, revision: str | None = None, download_dir: str | None = None
) -> str:
    """The local checkpoint directory of `model` (a directory, or a hub ID at `revision` in the hub cache or
    `download_dir`)."""
    if is_hub_id(model):
        from huggingface_hub import snapshot_download

        try:
            path = snapshot_download(
                model, revision=revision, cache_dir=download_dir, allow_patterns=HUB_FILES
            )
        except Exception as exc:  # offline and not cached, unknown repo, no access, network
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise CheckpointError(
                f"model {model!r}: no such directory, and the hub model could not be fetched "
                f"({type(exc).__name__}: {reason})"
            ) from None
    elif os.path.isdir(model):
        path = model
    else:
        raise CheckpointError(
            f"model {model!r}: no such directory (and not a hub model ID of the form org/name)"
        )
    if not os.path.isfile(os.path.join(path, "config.json")):
        from mmserve.models.registry import class_for_checkpoint

        if class_for_checkpoint(path) is None:  # a family's own layout (a NeVA's .nemo) needs none
            raise CheckpointError(
                f"model {model!r}: {path} has no config.json, so it is no checkpoint"
            )
    return path


def check_servable(model_dir: str) -> None:
    """CheckpointError when no family serves the checkpoint's architecture (names the supported ones)."""
    from mmserve.models.loader import load_hf_config
    from mmserve.models.registry import family_for_config, supported_architectures

    try:
        family_for_config(load_hf_config(model_dir))
    except ValueError as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if "supported architectures" not in message:
            message += f"; supported architectures: {', '.join(supported_architectures())}"
        raise CheckpointError(message) from None
