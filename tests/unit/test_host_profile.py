"""scripts/host_profile.py: the engine's host work per step by component, each timed function's own time without
the timed functions it calls, and a whole run of mixed steps on the tiny LLaVA on the CPU."""

from __future__ import annotations

import importlib.util
import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "host_profile.py"


def _script():
    spec = importlib.util.spec_from_file_location("host_profile", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_timed_function_counts_its_own_time_not_its_timed_callees():
    timers = _script().StepTimers(clock=itertools.count().__next__)  # each read: one tick later
    inner = timers.wrap(lambda: None, "inner")
    outer = timers.wrap(lambda: inner(), "outer")
    outer()  # reads: outer 0, inner 1 .. 2, outer 3
    parts = timers.take(total_s=10)
    assert parts == {"inner": 1, "outer": 2, "step other": 7}
    assert timers.take(total_s=0) == {"step other": 0}  # the next step starts from nothing


def test_installed_timers_are_taken_out_again():
    from mmserve.engine.scheduler import Scheduler
    from mmserve.worker import model_runner
    from mmserve.worker.sampling_batch import SamplingBatch

    module = _script()
    schedule, flatten, build = Scheduler.schedule, model_runner.flatten, SamplingBatch.build
    model = type(
        "Model", (), {"embed_input_ids": lambda self: 1, "compute_logits": lambda self: 2}
    )()
    with module.StepTimers().installed(model):
        assert Scheduler.schedule is not schedule and model_runner.flatten is not flatten
        assert model.compute_logits() == 2  # a timed method still returns its value
    assert (Scheduler.schedule, model_runner.flatten) == (schedule, flatten)
    assert SamplingBatch.build == build and "compute_logits" not in vars(model)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_reports_every_phase_of_its_mixed_steps(tiny_llava_dir, tmp_path):
    out = tmp_path / "report.json"
    args = ["--model", tiny_llava_dir, "--image-size", "42", "--num-requests", "24"]
    args += ["--input-len", "24", "--output-len", "6", "--max-num-seqs", "12"]
    args += ["--max-num-batched-tokens", "64", "--json", str(out)]
    run = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=280
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["kind"] == "mixed" and report["steps"] >= 3 and report["mean_seqs"] > 2
    parts = report["components_ms"]
    for name in ("schedule", "flatten", "attention metadata", "sampling batch", "read back"):
        assert parts[name] > 0, name
    assert parts["device: forward"] > 0 and report["host_ms"] > 0
    assert set(report["phases_ms"]) == {"schedule", "inputs", "launch", "resolve", "step"}
    assert "schedule" in run.stdout and "device work" in run.stdout
