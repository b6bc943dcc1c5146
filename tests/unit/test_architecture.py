"""The architecture rules of docs/architecture.md hold on the tree: layers, no capability probes or family
names outside models/, file sizes, Engine.step's length (scripts/arch_check.py measures them)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_architecture_rules_hold():
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "arch_check.py"), "--strict", "-v"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_checker_sees_a_probe_and_a_family_name(tmp_path, monkeypatch):
    """The rules can fail: a module outside models/ that probes the model and names a family is caught."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import arch_check
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    pkg = tmp_path / "mmserve"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "engine" / "bad.py").write_text(
        '"""x"""\n\ndef f(model):\n    return getattr(model, "uses_mrope", False) or "llava"\n'
    )
    monkeypatch.setattr(arch_check, "ROOT", pkg)
    found = arch_check.measure()
    assert len(found["capability probes outside models/"]) == 1
    assert found["family names outside models/ and testing/"] == [
        'mmserve/engine/bad.py:4: "llava"'
    ]
