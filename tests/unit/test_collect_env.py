"""`mmserve collect-env` reports the installed versions and the settings that matter, secrets masked; `mmserve
--version` says the version."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata

import mmserve


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mmserve.entrypoints.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )


def test_collect_env_reports_versions_and_masks_secrets():
    run = _cli("collect-env", HF_TOKEN="hf_secret_value", MMSERVE_API_KEY="k3y", HF_HUB_OFFLINE="1")
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert f"mmserve {mmserve.__version__}" in out
    assert f"  torch {metadata.version('torch')}\n" in out
    assert f"  transformers {metadata.version('transformers')}\n" in out
    assert "HF_HUB_OFFLINE=1" in out and "HF_TOKEN=<set>" in out and "MMSERVE_API_KEY=<set>" in out
    assert "hf_secret_value" not in out and "k3y" not in out
    assert "GPUs:" in out


def test_version_flag():
    run = _cli("--version")
    assert run.returncode == 0 and run.stdout.strip() == f"mmserve {mmserve.__version__}"
