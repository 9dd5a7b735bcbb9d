"""Build plans and plan-from-config (CPU), and an AOT build of a small plan into --out that a fresh process
finds, after the folder moved, with JIT disabled (nvcc, no GPU)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

from compile_checks import seed_planner
from flashgen import RoPE, cli
from flashgen.api import append as append_api
from flashgen.deploy import PlanError, plan_toml, read_plan, specs_from_config
from flashgen.spec import Causal, MergeSpec, NoMask, Paged, SlidingWindow
from flashgen.variants.examples import SINK
from stub_cuda import on_device

REPO = Path(__file__).resolve().parents[2]
CONFIGS = Path(__file__).parent / "configs"
PLANS = sorted((REPO / "plans").glob("*.toml"))
ATTENTION = ("decode", "prefill", "prefill_sm90")


def _config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


@pytest.mark.parametrize("path", PLANS, ids=[p.stem for p in PLANS])
def test_every_plan_parses_and_validates(path):
    model, builds = read_plan(path)
    assert model and builds
    assert {"decode", "prefill", "prefill_sm90", "merge_states", "append"} <= {op for op, _ in builds}


def test_the_older_json_list_still_reads(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps([{"op": "merge_states", "spec": {"type": "MergeSpec", "dtype": "float32"}}]))
    assert read_plan(path) == ("", [("merge_states", MergeSpec("float32"))])


@pytest.mark.parametrize("text, match", [
    ("model = 'm'\n[[kernel]]\nop = 'nope'\nspec = {}\n", "item 0: op 'nope'"),
    ("model = 'm'\n[[kernel]]\nop = 'decode'\nspec = { head_dim = 96 }\n", "item 0: spec: head_dim"),
    ("model = 'm'\n", "kernel"),
    ("model = [", "not valid TOML"),
])
def test_bad_plans_name_the_item(tmp_path, text, match):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(PlanError, match=match):
        read_plan(path)


def test_llama3_8b_config():
    facts, builds = specs_from_config(_config("Meta-Llama-3-8B"), (1, 16))
    assert (facts["head_dim"], facts["num_key_value_heads"], facts["rope_theta"]) == (128, 8, 500000.0)
    assert {s.kv_layout.page_size for op, s in builds if op == "decode"} == {1, 16}


def test_the_cache_write_in_the_forms_flashgen_calls_it():
    _, builds = specs_from_config(_config("Meta-Llama-3-8B"), (1, 16))
    writes = {(s.kv_layout.page_size, s.page_table, s.index_dtype, s.rope) for op, s in builds if op == "append"}
    assert writes == {(size, "slot_mapping", index, rope) for size in (1, 16)
                      for index, rope in (("int64", "none"), ("int32", "rope"))}
    assert all(s.head_dim == 128 and s.dtype == s.kv_dtype == "bfloat16" for op, s in builds if op == "append")
    # the same specs append_kv builds for those calls (its kernel lookup stubbed: no GPU)
    made = []

    def kernel(spec, device):
        made.append(spec)
        raise LookupError

    k, v = (on_device(torch.zeros(3, 8, 128, dtype=torch.bfloat16)) for _ in range(2))
    cache = on_device(torch.zeros(4, 2, 16, 8, 128, dtype=torch.bfloat16))
    calls = [{"slot_mapping": on_device(torch.arange(3))},  # the adapters, PagedKVCache.append
             {"slot_mapping": on_device(torch.arange(3, dtype=torch.int32)),  # PagedKVCache.write(rope=)
              "positions": on_device(torch.arange(3, dtype=torch.int32)), "rope": RoPE(500000.0)}]
    with mock.patch.object(append_api, "_kernel", kernel):
        for call in calls:
            with pytest.raises(LookupError):
                append_api.append_kv(k, v, cache, **call)
    assert set(made) == {s for op, s in builds if op == "append" and s.kv_layout.page_size == 16}


def test_mistral_windows_every_layer_and_gemma2_both():
    _, mistral = specs_from_config(_config("Mistral-7B-v0.1"))
    assert all(isinstance(s.mask, SlidingWindow) for op, s in mistral if op in ATTENTION)
    facts, gemma = specs_from_config(_config("gemma-2-9b"), dtype="bfloat16")
    assert facts["head_dim"] == 256 and facts["attn_logit_softcapping"] == 50.0
    kinds = {type(s.mask).__name__ for op, s in gemma if op == "prefill"}
    assert kinds == {"Causal", "SlidingWindow"} and all(s.soft_cap == 50.0 for op, s in gemma if op == "decode")


def test_qwen_gqa7_leaves_its_disabled_window_out():
    facts, builds = specs_from_config(_config("Qwen2.5-7B"))
    assert facts["num_attention_heads"] // facts["num_key_value_heads"] == 7 and facts["sliding_window"] is None
    assert not any(isinstance(s.mask, SlidingWindow) for op, s in builds if op in ATTENTION)


def test_gpt_oss_plans_both_layer_kinds_with_its_sinks(tmp_path):
    facts, builds = specs_from_config(_config("gpt-oss-20b"))
    assert facts["layers"] == "12 sliding_attention, 12 full_attention" and facts["attention_sinks"] is True
    attention = [(op, s) for op, s in builds if op in ATTENTION]
    assert {(op, s.mask) for op, s in attention if op == "decode"} == {("decode", NoMask()),
                                                                        ("decode", SlidingWindow(128))}
    assert {s.mask for op, s in attention if op == "prefill_sm90"} == {Causal(), SlidingWindow(128)}
    assert all(s.variant == SINK and s.head_dim == 64 for _, s in attention)
    path = tmp_path / "gpt-oss.toml"
    path.write_text(plan_toml("openai/gpt-oss-20b", facts, builds))
    assert read_plan(path) == ("openai/gpt-oss-20b", builds)  # the sinks' declarations read back


def test_a_multimodal_config_plans_its_text_model():
    facts, builds = specs_from_config(_config("gemma-3-4b-it"))
    assert (facts["head_dim"], facts["num_key_value_heads"], facts["dtype"]) == (256, 4, "bfloat16")
    assert facts["layers"] == "windowed and global layers alternate"
    assert {s.mask for op, s in builds if op == "prefill"} == {Causal(), SlidingWindow(1024)}


def test_layer_types_decide_the_masks():
    llama = _config("Meta-Llama-3-8B")
    types = ["linear_attention"] * 3 + ["full_attention"]
    facts, builds = specs_from_config({**llama, "layer_types": types * 8})
    assert facts["layers"] == "24 linear_attention, 8 full_attention"
    assert {s.mask for op, s in builds if op == "prefill"} == {Causal()}
    # a window in the config that no layer uses is left out
    _, builds = specs_from_config({**llama, "sliding_window": 4096, "layer_types": ["full_attention"] * 32})
    assert not any(isinstance(s.mask, SlidingWindow) for op, s in builds if op in ATTENTION)


@pytest.mark.parametrize("types, window, match", [
    (["chunked_attention", "full_attention"], None, "layer_types: 'chunked_attention' layers have no flashgen mask"),
    (["sliding_attention", "full_attention"], None, "sliding_window: layer_types names sliding_attention"),
    (["linear_attention", "mamba"], None, "layer_types: no softmax attention layer"),
    ("full_attention", None, "layer_types: got 'full_attention', expected a list"),
])
def test_layer_types_flashgen_cannot_plan_name_themselves(types, window, match):
    config = {**_config("Meta-Llama-3-8B"), "layer_types": types, "sliding_window": window}
    with pytest.raises(PlanError, match=match):
        specs_from_config(config)


@pytest.mark.parametrize("name, change, match", [
    ("gemma-2-9b", {}, "torch_dtype: got 'float32'.*--dtype bfloat16"),
    ("Phi-3-mini-4k", {}, "head_dim 96 \\(hidden_size / num_attention_heads\\)"),
    ("DeepSeek-V2-Lite", {}, "kv_lora_rank"),
    ("Meta-Llama-3-8B", {"num_key_value_heads": 5}, "num_key_value_heads: got 5"),
    ("Meta-Llama-3-8B", {"num_attention_heads": None}, "num_attention_heads: got None"),
    ("Meta-Llama-3-8B", {"hidden_size": 4095}, "hidden_size: 4095"),
])
def test_what_flashgen_cannot_serve_names_the_field(name, change, match):
    config = {k: v for k, v in {**_config(name), **change}.items() if v is not None}
    with pytest.raises(PlanError, match=match):
        specs_from_config(config)


def test_plan_from_config_command_writes_a_plan_that_reads_back(tmp_path, capsys):
    out = tmp_path / "qwen.toml"
    assert cli.main(["plan-from-config", str(CONFIGS / "Qwen2.5-7B.json"), "--page-size", "32", "--out", str(out)]) == 0
    model, builds = read_plan(out)
    assert model == "Qwen/Qwen2.5-7B" and (out.read_text().count("[[kernel]]") == len(builds) == 9)
    assert {s.kv_layout for op, s in builds if op == "decode"} == {Paged(32)}
    assert cli.main(["plan-from-config", str(CONFIGS / "Phi-3-mini-4k.json")]) == 2
    assert "head_dim 96" in capsys.readouterr().err


SMALL_PLAN = """model = "test"
[[kernel]]
op = "merge_states"
spec = { type = "MergeSpec", dtype = "bfloat16" }
[[kernel]]
op = "decode"
spec = { head_dim = 64, dtype = "bfloat16", kv_layout = { type = "Paged", page_size = 16 } }
"""

FIND_ALL = """
import sys, flashgen
from flashgen import jit
from flashgen.deploy import read_plan
from flashgen.api.backends import kernels_for
_, items = read_plan(sys.argv[1])
for op, spec in items:
    entry = flashgen.ensure_compiled(spec, op, "sm_90a")
    assert str(entry.path).startswith(sys.argv[2]), entry.path
print("found", len(items), "compiles", jit.stats["compiles"])
"""


@pytest.mark.nvcc
def test_aot_build_moved_then_found_with_jit_disabled(tmp_path, cache_dir, monkeypatch):
    plan = tmp_path / "small.toml"
    plan.write_text(SMALL_PLAN)
    out = tmp_path / "aot"
    seed_planner(out)  # the native planner the session loaded: not compiled again
    assert cli.main(["build", "--plan", str(plan), "--arch", "sm_90a", "-j", "2", "--out", str(out)]) == 0
    for manifest in out.rglob("manifest.json"):
        assert str(tmp_path) not in manifest.read_text()  # nothing names where it was built
    moved = tmp_path / "moved"
    shutil.move(out, moved)
    env = {**os.environ, "FLASHGEN_EXTRA_CACHE_DIRS": str(moved), "FLASHGEN_DISABLE_JIT": "1",
           "FLASHGEN_CACHE_DIR": str(tmp_path / "empty"), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", FIND_ALL, str(plan), str(moved)], env=env, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    assert "found 2 compiles 0" in done.stdout
