"""A gzip ``.nemo`` is listed once per process, not once per read (mmserve/models/nemo_archive.py): loading a NeVA
reads its archive six times (config, tokenizer, weights, vision tower, processor), and listing a gzip tar
decompresses all of it. Rewriting the file is noticed; a caller changing the config it got changes nothing else."""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

import pytest

from mmserve.llm import LLM
from mmserve.models.nemo_archive import (
    iter_nemo_weights,
    nemo_tokenizer_file,
    read_nemo_config,
)
from mmserve.sampling_params import SamplingParams
from mmserve.testing.neva import NEMO_NAME, make_neva_checkpoint


@pytest.fixture()
def gzip_nemo(tmp_path) -> Path:
    return make_neva_checkpoint(
        tmp_path / "neva", preset="tiny", seed=0, compress=True, progress=False
    )


@pytest.fixture()
def listings(monkeypatch) -> list[str]:
    """The archives whose members were listed (tarfile.TarFile.getmembers calls), in order."""
    calls: list[str] = []
    real = tarfile.TarFile.getmembers

    def counted(self):
        calls.append(str(self.name))
        return real(self)

    monkeypatch.setattr(tarfile.TarFile, "getmembers", counted)
    return calls


def test_loading_a_gzip_neva_lists_its_archive_once(gzip_nemo, listings):
    llm = LLM(str(gzip_nemo), device="cpu", dtype="float32")
    out = llm.generate(["Hello"], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    assert listings == [str(gzip_nemo / NEMO_NAME)]


def test_a_rewritten_archive_is_read_again(gzip_nemo, listings, tmp_path):
    nemo = gzip_nemo / NEMO_NAME
    before = read_nemo_config(nemo)
    other = make_neva_checkpoint(
        tmp_path / "other", preset="tiny-swiglu", seed=1, compress=True, progress=False
    )
    os.replace(other / NEMO_NAME, nemo)  # the same path, another file: another size and mtime
    after = read_nemo_config(nemo)
    assert listings.count(str(nemo)) == 2
    assert after != before
    assert dict(iter_nemo_weights(nemo)).keys() != set()
    assert listings.count(str(nemo)) == 2


def test_a_changed_config_does_not_change_the_next_read(gzip_nemo, tmp_path):
    cfg = read_nemo_config(gzip_nemo)
    cfg["mm_cfg"]["vision_encoder"]["from_pretrained"] = "elsewhere"
    cfg["hidden_size"] = -1
    again = read_nemo_config(gzip_nemo)
    assert again["hidden_size"] != -1
    assert again["mm_cfg"]["vision_encoder"]["from_pretrained"] != "elsewhere"
    assert nemo_tokenizer_file(gzip_nemo, tmp_path / "tok").is_file()
