"""The CogVLM family's own rules against the reference's (tests/parity/cogvlm_reference.py, from THUDM's
`build_position_ids` and `get_expert_mask`): positions, picture rows per version, the visual expert's rows, the
config read without remote code, and the roofline's kv heads."""

from __future__ import annotations

import pytest

from mmserve.bench.roofline import lm_shape
from mmserve.models.cogvlm import image_rows
from mmserve.models.loader import load_hf_config
from mmserve.models.registry import get_model_class
from mmserve.testing import make_test_image
from mmserve.testing.cogvlm import (
    cogvlm2_config,
    cogvlm_config,
    make_cogvlm2_checkpoint,
    make_cogvlm_checkpoint,
)
from mmserve.worker.request_inputs import media_rows
from tests.parity.cogvlm_reference import reference_positions, vision_expert_rows


@pytest.fixture(scope="module", params=["v1", "v2"])
def model_dir(request, tmp_path_factory):
    make = make_cogvlm_checkpoint if request.param == "v1" else make_cogvlm2_checkpoint
    return str(make(tmp_path_factory.mktemp(f"cog_{request.param}")))


def test_positions_and_rows_follow_the_original(model_dir):
    config = load_hf_config(model_dir)
    cls = get_model_class(config)
    processor = cls.build_processor(model_dir, config)
    enc = processor(text="Question: hi there? Answer:", images=[make_test_image(3)])
    ids = enc["input_ids"][0].tolist()
    ((offset, n),) = enc["image_spans"]
    assert (
        offset == 1 and n == image_rows(config) == 6 and ids[0] == processor.tokenizer.bos_token_id
    )
    types = [0] + [1] * n + [0] * (len(ids) - 1 - n)
    positions, delta = cls.prompt_positions(config, enc, ids)
    assert positions[0].tolist() == reference_positions(types)
    assert delta == positions[0, -1].item() - (
        len(ids) - 1
    )  # decoding goes on from the last position
    items = cls.build_mm_items(config, enc, ids, ["k"], [])
    step = _Scheduled(_Request(items), start=0, num_tokens=len(ids))
    rows = media_rows([step], [0, len(ids)], cls.family.media_rows)
    assert rows == [i for i, v in enumerate(vision_expert_rows(types)) if v]
    text_only = processor(text="Question: hi? Answer:")
    assert cls.prompt_positions(config, text_only, text_only["input_ids"][0].tolist()) == (None, 0)


class _Request:
    def __init__(self, items):
        self.mm_items = items


class _Scheduled:
    def __init__(self, request, start, num_tokens):
        self.request, self.start, self.num_tokens = request, start, num_tokens


def test_chunked_rows_are_the_uncut_rows():
    """Rows of chunks cut anywhere concatenate to the uncut prompt's rows (eoi excluded by the span, not the cut)."""
    from mmserve.core.multimodal import MultiModalItem

    req = _Request([MultiModalItem("image", {}, 1, 6, "k")])
    whole = media_rows([_Scheduled(req, 0, 12)], [0, 12], "span_but_last")
    for cut in range(1, 12):
        a = media_rows([_Scheduled(req, 0, cut)], [0, cut], "span_but_last")
        b = media_rows([_Scheduled(req, cut, 12 - cut)], [0, 12 - cut], "span_but_last")
        assert a + [r + cut for r in b] == whole == [1, 2, 3, 4, 5]


def test_real_presets_rows_and_versions(tmp_path):
    """cogvlm-chat-17b: 35×35 patches + boi, eoi = 1227 rows; cogvlm2-19b: 96×96 halved = 48×48 + 2 = 2306."""
    for config, version, rows in (
        (cogvlm_config("cogvlm-chat-17b"), 1, 1227),
        (cogvlm2_config("cogvlm2-19b"), 2, 2306),
    ):
        config.save_pretrained(tmp_path / str(version))
        ours = load_hf_config(str(tmp_path / str(version)))
        assert (ours.version, image_rows(ours)) == (version, rows)


def test_roofline_reads_the_v2_kv_heads(model_dir):
    config = load_hf_config(model_dir)
    shape = lm_shape(model_dir, "float32")
    assert shape.kv_heads == config.text_config.num_key_value_heads
