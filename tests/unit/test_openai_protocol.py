"""OpenAI request models: content parts map onto the InputProcessor's chat format."""
from __future__ import annotations

import pydantic
import pytest

from mmserve.entrypoints.openai_protocol import ChatMessage


def test_text_image_and_video_parts_become_template_parts():
    msg = ChatMessage.model_validate({"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
        {"type": "image_url", "image_url": "http://127.0.0.1/x.png"},
        {"type": "text", "text": "compare"}]})
    assert msg.to_template()["content"] == [
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}},
        {"type": "text", "text": "compare"}]


def test_unknown_part_type_is_rejected():
    with pytest.raises(pydantic.ValidationError):
        ChatMessage.model_validate({"role": "user", "content": [{"type": "audio_url", "audio_url": "x"}]})
