"""Pure logic of the peer benchmarks (tools/bench/peer.py): no engine, no llama.cpp, no cgroup is touched."""

import os

import pytest

from tools.bench import peer as P

LLAMA_BENCH_JSONL = """\
{"build_commit": "unknown", "model_type": "glm4moe ?B all F32", "n_threads": 2, "n_prompt": 16, "n_gen": 0, "n_depth": 0, "avg_ns": 1248045, "stddev_ns": 0, "avg_ts": 12820.050559, "stddev_ts": 0.0, "samples_ns": [1248045, 1300000, 1200000], "samples_ts": [12820.1, 11000.0, 13000.0]}
{"build_commit": "unknown", "model_type": "glm4moe ?B all F32", "n_threads": 2, "n_prompt": 0, "n_gen": 64, "n_depth": 16, "avg_ns": 12948202, "stddev_ns": 0, "avg_ts": 4942.771205, "stddev_ts": 0.0, "samples_ns": [12948202], "samples_ts": [4942.77]}
"""


def test_llama_bench_output_parsed_from_jsonl_and_json():
    rows = P.parse_llama_bench(LLAMA_BENCH_JSONL)
    assert [(r["n_prompt"], r["n_gen"], r["n_depth"]) for r in rows] == [(16, 0, 0), (0, 64, 16)]
    assert P.bench_rate(rows, 16, 0) == 12820.1              # median of the samples
    assert P.bench_rate(rows, 0, 64) == 4942.77
    as_json = "[\n" + ",\n".join(LLAMA_BENCH_JSONL.strip().splitlines()) + "\n]"
    assert P.parse_llama_bench(as_json) == rows
    with pytest.raises(P.BenchError, match="n_prompt=512"):
        P.bench_rate(rows, 512, 0)
    assert P.parse_llama_bench("") == []


def test_format_mapping_and_dense_formats():
    # no --dense_formats: the converter's default and the GGUF's bits, one row where the default is those bits
    assert P.format_plan(["f32", "int8_row", "int4_g64"], None) == [
        ("f32", "f32", "F32"), ("int8_row", "auto", "Q8_0"), ("int8_row", "int8", "Q8_0"),
        ("int4_g64", "auto", "Q4_0"), ("int4_g64", "int4_g64", "Q4_0")]
    from glm_jax.experts.convert import auto_dense_format
    assert P.format_plan(["int8_row", "int4_g64"], None, auto_dense_format) == [
        ("int8_row", "auto", "Q8_0"), ("int4_g64", "auto", "Q4_0")]
    assert P.format_plan(["int4_g64"], None, lambda f: "bf16") == [("int4_g64", "auto", "Q4_0"),
                                                                   ("int4_g64", "int4_g64", "Q4_0")]
    assert P.format_plan(["f32", "int4_g64"], ["bf16"]) == [("f32", "f32", "F32"), ("int4_g64", "bf16", "Q4_0")]
    assert P.format_plan(["int8_row", "int4_g64"], ["f32", "int4_g64"])[1] == ("int4_g64", "int4_g64", "Q4_0")
    with pytest.raises(P.BenchError, match="unknown format 'q5'"):
        P.format_plan(["q5"], None)
    with pytest.raises(P.BenchError, match="2 entries for 3 formats"):
        P.format_plan(["f32", "int8_row", "int4_g64"], ["int8", "int8"])
    assert P.parse_options("mtp=false, fetch=loop") == {"mtp": "false", "fetch": "loop"}
    with pytest.raises(P.BenchError, match="name=value"):
        P.parse_options("mtp")
    assert P.parse_list("4000, 700", "limits", float) == [4000.0, 700.0]
    with pytest.raises(P.BenchError):
        P.parse_list("a,b", "limits", float)


def test_peer_table_ratios_and_token_agreement():
    toks = list(range(40))
    cells = [
        dict(model="m", fmt="f32", fmt_label="f32 ↔ F32", engine="llama.cpp", weights="w", decode=[100.0, 90.0, 110.0],
             prefill=[1000.0], tokens=toks),
        dict(model="m", fmt="f32", fmt_label="f32 ↔ F32", engine="glm-jax", weights="w", decode=[50.0, 60.0, 40.0],
             prefill=[2000.0], tokens=toks[:20] + [0] * 20),
        dict(model="m", fmt="f32", fmt_label="f32 ↔ F32", engine="transformers", weights="w", decode=[25.0],
             prefill=[500.0], tokens=list(toks)),
        dict(model="m", fmt="int4_g64", fmt_label="x", engine="glm-jax", weights="w", decode=[], prefill=[],
             error="boom"),
    ]
    rows = P.peer_rows(cells, 32)
    col = "same greedy tokens (first 32)"
    assert rows[0]["decode vs llama.cpp"] == 1.0 and rows[0][col] == "(reference)"
    assert rows[1]["decode tok/s"] == 50.0 and rows[1]["decode vs llama.cpp"] == 0.5
    assert rows[1]["prefill vs llama.cpp"] == 2.0
    assert rows[1][col] == "no (first difference at token 20)"
    assert rows[2][col] == "yes" and rows[2]["decode vs llama.cpp"] == 0.25
    assert rows[3][col] == "error: boom" and rows[3]["decode vs llama.cpp"] is None
    assert P.same_tokens([1, 2], [1, 2, 3]) == "no (only 2 tokens)"
    assert P.same_tokens(None, [1]) == "–"


def test_lowram_helpers():
    assert P.ram_gb_for_limit(1400, 500, 100) == 0.8
    assert P.ram_gb_for_limit(500, 600, 100) == 0.0
    assert P.classify_run(0, False, 0) == "ok"
    assert P.classify_run(-9, False, 1) == "OOM-killed"
    assert P.classify_run(-9, False, 0) == "killed (SIGKILL)"
    assert P.classify_run(None, True, 0) == "timeout"
    assert P.classify_run(3, False, 0, "RamBudgetError: too small") == "cannot start: RamBudgetError: too small"
    assert P.classify_run(3, False, 0, "x", started=True) == "failed: x"
    cells = {(4000.0, "llama0"): {"tok_s": [40.0, 42.0], "verdict": "ok", "note": "peak 1900 MB"},
             (4000.0, "glmjax"): {"tok_s": [2.0], "verdict": "ok", "note": "", "flags": "--ram_gb=3.4 --direct_io"},
             (700.0, "llama0"): {"tok_s": [], "verdict": "OOM-killed", "note": "OOM-killed, peak 700 MB"},
             (700.0, "glmjax"): {"tok_s": [], "verdict": "cannot start: RamBudgetError: x", "note": "n"}}
    rows = P.lowram_rows(cells, [4000.0, 700.0], [("llama0", "llama.cpp"), ("glmjax", "glm-jax")])
    assert rows[0]["memory limit"] == "4000 MB" and rows[0]["llama.cpp"] == "41" and rows[0]["glm-jax"] == "2"
    assert rows[0]["glm-jax flags"] == "--ram_gb=3.4 --direct_io"
    assert rows[1]["llama.cpp"] == "OOM-killed" and rows[1]["glm-jax"] == "cannot start"
    assert "llama.cpp: OOM-killed, peak 700 MB" in rows[1]["notes"]


V1_SELF = "4:memory:/process_api/abc\n3:cpuset:/\n0::/\n"


def _v1_tree(tmp_path, own=True):
    mem = tmp_path / "memory"
    (mem / "process_api" / "abc" if own else mem).mkdir(parents=True)
    (mem / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    return mem


def test_cgroup_detection_and_skip_messages(tmp_path):
    cg, why = P.detect_cgroup(V1_SELF, str(tmp_path), euid=1000)
    assert cg is None and why == "memory cgroups need root (this process runs as uid 1000)"
    cg, why = P.detect_cgroup(V1_SELF, str(tmp_path), euid=0)
    assert cg is None and "no cgroup memory controller" in why
    mem = _v1_tree(tmp_path)
    cg, why = P.detect_cgroup(V1_SELF, str(tmp_path), euid=0)
    assert why == "" and cg.kind == "v1" and cg.parent == str(mem / "process_api" / "abc")
    assert os.listdir(cg.parent) == []                           # the writability probe cleaned up after itself
    cg, _ = P.detect_cgroup("4:memory:/elsewhere\n", str(tmp_path), euid=0, probe=False)
    assert cg.parent == str(mem)                                 # own group not visible: the controller's root


def test_cgroup_v2_detection(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("cpu io memory pids\n")
    (tmp_path / "cgroup.subtree_control").write_text("cpu\n")
    cg, why = P.detect_cgroup("0::/user.slice\n", str(tmp_path), euid=0)
    assert cg is None and "memory is not enabled" in why
    (tmp_path / "cgroup.subtree_control").write_text("cpu memory\n")
    cg, why = P.detect_cgroup("0::/user.slice\n", str(tmp_path), euid=0, probe=False)
    assert cg == P.Cgroup("v2", str(tmp_path)) and why == ""


def _fake_llamacpp(tmp_path, bench_body: str, server_body: str = "exit 3") -> str:
    """A PREFIX whose bin/llama-bench and bin/llama-server are shell scripts with these bodies."""
    b = tmp_path / "bin"
    b.mkdir(parents=True)
    for name, body in (("llama-bench", bench_body), ("llama-server", server_body)):
        p = b / name
        p.write_text("#!/bin/sh\n" + body + "\n")
        p.chmod(0o755)
    return str(tmp_path)


def test_a_peer_whose_defaults_crash_is_named_and_one_that_runs_is_not(tmp_path):
    crash = _fake_llamacpp(tmp_path / "a", "kill -SEGV $$")
    assert P.llama_defaults_crash(crash, "m.gguf", 1, str(tmp_path / "a.log")) == "llama-bench killed by SIGSEGV"
    ok = _fake_llamacpp(tmp_path / "b", "echo '" + LLAMA_BENCH_JSONL.splitlines()[0] + "'")
    assert P.llama_defaults_crash(ok, "m.gguf", 1, str(tmp_path / "b.log")) == ""
    silent = _fake_llamacpp(tmp_path / "c", "exit 0")                   # exits 0 without a result
    assert P.llama_defaults_crash(silent, "m.gguf", 1, str(tmp_path / "c.log")) == "llama-bench exit 0, no result"


def test_a_llama_server_that_dies_at_start_is_a_bench_error_not_a_process_lookup_error(tmp_path):
    # a server that crashed at start: the cleanup's killpg on its gone process group raised
    # ProcessLookupError, which hid the BenchError naming the crash
    prefix = _fake_llamacpp(tmp_path, "exit 0", "exit 7")
    with pytest.raises(P.BenchError, match="exited 7"):
        P.llama_greedy_tokens(prefix, "m.gguf", [1, 2, 3], 4, 1, str(tmp_path / "srv.log"))
