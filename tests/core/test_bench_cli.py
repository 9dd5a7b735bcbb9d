"""`flashgen bench` on the CPU: the command line, the no-GPU exit, the ratio table, JSON, markdown and plot of a
run built from saved H200 results (benchmarks/results), the command's plumbing with the measuring stubbed, and
the benchmarks/ entry points that now call the package."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flashgen import cli
from flashgen.bench import command, decode, prefill, report

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
DECODE = json.loads((RESULTS / "decode-0be46fb-2026-11-29.json").read_text())
PREFILL = json.loads((RESULTS / "prefill-ed1d408-2026-11-30.json").read_text())


def canned_run() -> dict:
    ops = {"decode": DECODE, "prefill": PREFILL}
    return {"device": "NVIDIA H200", "date": "2026-11-30", "commit": "abc1234", "copy_GBps": 4248.0,
            "matmul_TFLOPs": 795.0, "grid": "default", "seconds": 123.0,
            "peers": {"found": {"sdpa": "torch 2.11.0", "flashinfer": "flashinfer 0.6.8"},
                      "missing": {"flashinfer-fa3": "ImportError: no"}},
            "ops": ops, "ratios": {"decode": decode.ratios(DECODE), "prefill": prefill.ratios(PREFILL)}}


def main(capsys, *args):
    """(exit code, stdout, stderr) of ``flashgen *args`` in this process; argparse's exits become codes."""
    try:
        code = cli.main(list(args))
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_help_names_the_ops_and_options(capsys):
    code, out, _ = main(capsys, "bench", "--help")
    assert code == 0
    for word in ("{decode,prefill,all}", "--peers", "--plot FILE", "--out DIR", "--quick", "flashinfer-fa3"):
        assert word in out, word
    code, out, _ = main(capsys, "--help")
    assert code == 0 and "bench" in out


@pytest.mark.parametrize("args, message", [
    (("bench", "--peers", "sdpa,nccl", "decode"), "--peers: unknown nccl; expected a comma list of sdpa, flex"),
    (("bench", "everything"), "invalid choice: 'everything'"),
])
def test_bad_arguments_name_the_argument(capsys, args, message):
    code, _, err = main(capsys, *args)
    assert code == 2 and message in err, err


def test_peer_list_parses():
    assert command._peer_list("sdpa, flex,sdpa") == ["sdpa", "flex"]
    assert command._peer_list("") == []


def test_without_a_gpu_it_says_so_and_exits_1():
    done = subprocess.run([sys.executable, "-m", "flashgen.cli", "bench", "all"], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("flashgen bench: error: no CUDA GPU visible"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_decode_ratios_match_the_rows():
    ratios = decode.ratios(DECODE)
    us = {(r["peer"], r["batch"], r["kv_len"], str(r["page_size"])): r["us"] for r in DECODE["rows"]}
    got = {(shape, peer): value for shape, peer, value in ratios}
    # a paged peer meets flashgen at its own page size
    assert got["B16 L16k p16", "flashinfer-tc"] == pytest.approx(us["flashinfer-tc", 16, 16384, "16"]
                                                                 / us["flashgen", 16, 16384, "16"])
    # a contiguous peer meets flashgen at every page size
    for page in (1, 16, 64, 256):
        assert got[f"B16 L16k p{page}", "sdpa-flash"] == pytest.approx(us["sdpa-flash", 16, 16384, "contig"]
                                                                       / us["flashgen", 16, 16384, str(page)])
    assert {peer for _, peer, _ in ratios} == {r["peer"] for r in DECODE["rows"]} - {"flashgen"}
    assert all(value > 0 for _, _, value in ratios)


def test_prefill_ratios_take_flashgens_fastest_backend():
    ratios = prefill.ratios(PREFILL)
    rows = [r for r in PREFILL["rows"] if (r["head_dim"], r["batch"], r["seqlen"], r["mask"]) == (128, 4, 4096, "causal")]
    ours = min(r["us"] for r in rows if r["peer"].startswith("flashgen") and r["layout"] == "ragged")
    fa3 = next(r["us"] for r in rows if r["peer"] == "flashinfer-fa3")
    got = {(shape, peer): value for shape, peer, value in ratios}
    assert got["d128 4x4k causal ragged", "flashinfer-fa3"] == pytest.approx(fa3 / ours)
    assert not any(peer.startswith("flashgen") for _, peer, _ in ratios)
    assert ("d128 4x4k doc paged16", "flashinfer") not in got  # FlashInfer runs no document mask


def test_ratio_table_is_a_row_per_shape_and_a_column_per_peer():
    ratios = [("B1 L4k p16", "flashinfer-tc", 1.25), ("B1 L4k p16", "sdpa-flash", 0.5), ("B8 L4k p16", "sdpa-flash", 2.0)]
    lines = report.ratio_table("decode", ratios).strip().splitlines()
    assert lines[2] == "| shape | flashinfer-tc | sdpa-flash |"
    assert lines[4:] == ["| B1 L4k p16 | 1.25 | 0.50 |", "| B8 L4k p16 | – | 2.00 |"]
    assert "no peer measured" in report.ratio_table("decode", [])


def test_write_run_writes_json_and_markdown(tmp_path):
    run = canned_run()
    tables = {"decode": decode.markdown, "prefill": prefill.markdown}
    json_path, md_path = report.write_run(run, tmp_path / "new", tables)
    assert json_path.name == "bench-decode-prefill-abc1234-2026-11-30.json"
    back = json.loads(json_path.read_text())
    assert back["ops"]["decode"]["rows"] == DECODE["rows"] and back["copy_GBps"] == 4248.0
    assert back["ratios"]["prefill"][0] == list(run["ratios"]["prefill"][0])
    text = md_path.read_text()
    assert text.startswith("# flashgen bench, NVIDIA H200, 2026-11-30, commit abc1234\n")
    assert "copy rate 4248 GB/s; bf16 matmul 795 TFLOP/s; 123 s" in text
    assert "peers found: sdpa torch 2.11.0, flashinfer flashinfer 0.6.8; not found: flashinfer-fa3: ImportError" in text
    assert "# Decode, NVIDIA H200" in text and "# Prefill, NVIDIA H200" in text
    assert "## decode: flashgen / peer" in text and "## prefill: flashgen / peer" in text


@pytest.mark.parametrize("suffix, magic", [(".png", b"\x89PNG"), (".svg", b"<?xml")])
def test_plot_writes_a_panel_per_op(tmp_path, suffix, magic):
    pytest.importorskip("matplotlib")
    path = tmp_path / f"bench{suffix}"
    report.plot_ratios(canned_run(), path)
    assert path.read_bytes().startswith(magic)
    if suffix == ".svg":
        text = path.read_text()
        assert "decode (&gt; 1: flashgen faster)" in text and "prefill (&gt; 1: flashgen faster)" in text


def test_plot_without_ratios_says_so(tmp_path):
    pytest.importorskip("matplotlib")
    run = {**canned_run(), "ratios": {"decode": [], "prefill": []}}
    with pytest.raises(ValueError, match="no peer was measured"):
        report.plot_ratios(run, tmp_path / "x.png")


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch says a Hopper GPU is there; the rates and the measuring return saved H200 numbers."""
    import torch

    from flashgen.bench import timing

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(timing, "copy_rate", lambda: 4248.0)
    monkeypatch.setattr(timing, "matmul_rate", lambda: 795.0)
    seen = {}

    def measure(rows):
        def fn(cfg, rate, progress):
            seen.setdefault("peers", []).append(set(cfg.peers))
            progress.write("one shape done")
            return rows
        return fn

    monkeypatch.setattr(decode, "measure", measure(DECODE["rows"]))
    monkeypatch.setattr(prefill, "measure", measure(PREFILL["rows"]))
    monkeypatch.setattr(prefill, "build", lambda cfg, progress_class: seen.setdefault("backends", cfg.backends))
    monkeypatch.setattr(decode, "build", lambda cfg, progress_class: seen.setdefault("page_sizes", cfg.page_sizes))
    return seen


def test_bench_all_writes_tables_json_and_plot(capsys, tmp_path, fake_gpu):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "bench.png"
    code, out, err = main(capsys, "bench", "all", "--peers", "sdpa,flashinfer", "--out", str(tmp_path / "runs"),
                          "--plot", str(plot), "--commit", "abc1234", "--quick")
    assert code == 0, err
    assert "peers found: sdpa (torch " in out
    assert fake_gpu["peers"][0] <= {"sdpa", "flashinfer"} and fake_gpu["backends"] == ["portable", "sm90"]
    assert fake_gpu["page_sizes"] == [16]
    assert "copy rate 4248 GB/s, bf16 matmul 8192^3 795 TFLOP/s" in out
    assert "## decode: flashgen / peer" in out and "## prefill: flashgen / peer" in out
    [json_path] = (tmp_path / "runs").glob("bench-decode-prefill-abc1234-*.json")
    run = json.loads(json_path.read_text())
    assert run["grid"] == "quick" and run["matmul_TFLOPs"] == 795.0 and run["copy_GBps"] == 4248.0
    assert set(run["ops"]) == {"decode", "prefill"} and run["ratios"]["decode"]
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_bench_checks_plot_before_measuring(capsys, tmp_path, fake_gpu, monkeypatch):
    code, _, err = main(capsys, "bench", "decode", "--plot", str(tmp_path / "missing" / "x.png"))
    assert code == 2 and "--plot" in err and "does not exist" in err
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, _, err = main(capsys, "bench", "decode", "--plot", str(tmp_path / "x.png"))
    assert code == 2 and "matplotlib is not installed (pip install 'flashgen[plot]')" in err
    assert "peers" not in fake_gpu  # nothing measured


def test_grids_are_valid_options_of_the_scripts():
    import argparse

    for op, module in (("decode", decode), ("prefill", prefill)):
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        known = {action.dest for action in parser._actions}
        for grid in command.GRIDS[op].values():
            assert set(grid) <= known, (op, set(grid) - known)
    cfg = decode.config(argparse.Namespace(**command.GRIDS["decode"]["default"], peers="sdpa"))
    assert len(list(decode.configs(cfg.max_kv_gb, cfg.batches, cfg.kv_lens))) == 8  # all fit in 18 GB


def test_entry_points_import_and_alias_the_package():
    code = ("import sys; sys.path.insert(0, 'benchmarks'); import timing, bench_decode, bench_prefill, "
            "bench_cascade, bench_sparse, bench_host, bench_append, bench_foundation, bench_prefill_mixed, "
            "bench_prefill_sm90; import flashgen.bench.timing as t, flashgen.bench.prefill as p; "
            "assert timing is t and bench_prefill is p; from bench_decode import BYTES_PER_TOKEN, paged_table; "
            "print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.stdout.strip() == "ok", done.stderr
    done = subprocess.run([sys.executable, "benchmarks/bench_prefill.py", "--help"], capture_output=True, text=True,
                          cwd=REPO)
    assert done.returncode == 0 and "--backends" in done.stdout, done.stderr


def test_progress_is_plain_lines_off_a_terminal(capsys):
    from flashgen.progress import Progress

    with Progress(2, "shape") as bar:
        bar.note("a note")
        bar.write("first")
        bar.write("second")
    assert capsys.readouterr().out == "a note\n[1/2] first\n[2/2] second\n"
