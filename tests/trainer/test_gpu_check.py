"""benchmarks/gpu_check.py at a tiny size on the CPU (its ``--device cpu`` self-test), so the script
the GPU machine runs is known to work before device time is spent on it."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rollstream.trainer.corrections import parse_correction_config

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
CHECKS = {"correction_token", "correction_segment", "correction_geometric", "correction_sequence",
          "correction_helpers", "train_step_float32", "train_step_bfloat16", "vllm_reload_in_place"}
# What a bare CUDA machine lacks (the image the GPU check runs on has torch and transformers only).
MISSING = ("pydantic", "pydantic_core", "fastavro", "kafka", "faust", "typer", "vllm", "lz4")


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_self_test_passes_without_rollstreams_other_dependencies(tmp_path):
    # Python sees a module set to None in sys.modules as not installed (find_spec -> None).
    runner = (f"import runpy, sys\nfor name in {MISSING!r}: sys.modules[name] = None\n"
              f"sys.argv = [{str(SCRIPT)!r}, '--device', 'cpu', '--tiny', '--out', {str(tmp_path / 'r.json')!r}]\n"
              f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", runner], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((tmp_path / "r.json").read_text())
    assert json.loads(proc.stdout) == result
    assert result["ok"] is True and result["device"] == "cpu" and result["sizes"]["mask"] == [4, 256]
    assert set(result["checks"]) == CHECKS
    assert result["skipped"] == {"vllm_reload_in_place": "vLLM is not installed in this Python "
                                                         "(pip install vllm; on a CPU: make vllm-env)"}
    assert all(check["ok"] is True for name, check in result["checks"].items() if name not in result["skipped"])
    assert "gpu_check: vllm_reload_in_place: skipped: vLLM is not installed" in proc.stderr
    checks = result["checks"]
    for agg in ("token", "segment", "geometric", "sequence"):  # CPU against CPU: bit for bit
        c = checks[f"correction_{agg}"]
        assert (c["mask_flips_off_border"], c["mask_flips_at_border"], c["weight_max_abs_diff"]) == (0, 0, 0.0)
        assert c["metrics_differing"] == []
    step = checks["train_step_float32"]
    assert step["cpu"]["loss"] == step["device"]["loss"] and step["old_log_probs_max_abs_diff"] == 0.0
    assert step["final_mask_equal"] is True and step["tokens_trained"] > 0
    assert "gpu_check: train_step_bfloat16: ok" in proc.stderr
    # what it imported: the four trainer modules, stand-ins for the two that need pydantic/fastavro
    config, packed = result["stand_ins"]
    assert config.startswith("rollstream.config.corrections: import of pydantic halted")
    assert config.endswith("-> configs read as namespaces")
    assert packed.startswith("rollstream.schemas.packed: No module named 'fastavro.read'")
    assert packed.endswith("-> unpack_array raises")
    assert result["heavy_modules_loaded"] == []
    loaded = set(result["rollstream_modules"])
    assert {"rollstream.trainer.batch", "rollstream.trainer.corrections", "rollstream.trainer.grpo",
            "rollstream.trainer.logprobs"} <= loaded
    # no config model, Avro codec, Kafka client or policy loader came along
    assert not {"rollstream.config.base", "rollstream.schemas.codec", "rollstream.policy.model"} & loaded
    assert not {m for m in loaded if m.startswith(("rollstream.kafka", "rollstream.workers", "rollstream.streams"))}


def test_its_configs_spell_out_every_field():
    # the stand-in reads the configs as given: the real parser must fill in no default
    script = load_script()
    for config in [*(script.correction_config(agg) for agg in script.AGGS), script.STEP_CORRECTION]:
        assert parse_correction_config(config).model_dump() == config


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer of a machine without CUDA")
def test_without_cuda_it_says_so_and_exits_2(capsys):
    code = load_script().main([])
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert code == 2 and result["ok"] is False and "checks" not in result
    assert result["error"].startswith("CUDA is not available")
    assert "gpu_check: CUDA is not available" in captured.err


@pytest.mark.integration
@pytest.mark.vllm
def test_its_vllm_section_loads_new_weights_into_the_same_engine(vllm_gpu_check):
    """Run by the vLLM environment's Python (its CPU build): the section a CUDA machine with vLLM runs."""
    result = vllm_gpu_check
    assert result["ok"] is True and result["skipped"] == {}
    check = result["checks"]["vllm_reload_in_place"]
    assert check["ok"] is True and check["answer_changed"] is True
    # bfloat16 engine against float32 forward passes of a random 2-layer model
    assert check["before_off_its_weights"] < 0.1 and check["after_off_new_weights"] < 0.1
    assert check["after_off_old_weights"] > 0.1 and check["reload_ms"] > 0
