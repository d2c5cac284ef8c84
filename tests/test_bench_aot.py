"""bench/hlo_cycles.py on a hand-written TPU HLO module, and bench/aot.py where libtpu is absent.

The fixture (tests/fixtures/hlo/loops.hlo.txt) holds, in the optimized HLO's own syntax:

* ``while.1``: trip count 3 inferred (a constant 0 in its operand tuple, a fused ``compare(iv, 3)
  LT`` as its condition's root, ``add(iv, 1)`` in its body); its body a kOutput dot fusion of 1000
  cycles and ``while.2`` (``known_trip_count`` 4) around a reduce fusion of 10; its condition's
  fusion 2 cycles, run 3 + 1 times;
* ``while.3``: bound from the loop tuple (data-dependent), body a fusion of 100;
* ``cond.1``: branches of 300 and 200 cycles; a splash-named ``tpu_custom_call`` spanning three
  lines without an estimate; a copy of 40; a ``call`` of a computation holding a fusion of 7.

No test here needs libtpu; the compile itself does, and is run by hand: ``python -m bench.aot CASE --cycles``.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import aot
from bench.hlo_cycles import count_iterations, estimate_cycles, infer_trip_count, main, parse_hlo

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "fixtures" / "hlo" / "loops.hlo.txt"
# 3 x (1000 + 4 x 10) + (3 + 1) x 2 + 2.0 x 100 + 200 (last branch) + 40 + 7
TOTAL_LAST = 3575


@pytest.fixture(scope="module")
def module():
    return parse_hlo(FIXTURE.read_text())


def test_the_parser_reads_computations_roots_and_a_multi_line_custom_call(module) -> None:
    assert module.entry.name == "main.1"
    assert len(module.computations) == 15
    call = module.entry.by_name["splash_mha_fwd.1"]
    assert call.opcode == "custom-call" and call.operands == ["cond.1"] and call.cycles is None
    assert call.quoted("custom_call_target") == "tpu_custom_call" and "pallas_call" in call.quoted("op_name")
    assert module.entry.root is not None and module.entry.root.name == "call.1"
    outer = module.entry.by_name["while.1"]
    assert outer.operands == ["tuple.1"] and outer.attr("body") == "outer_body"
    assert module.computations["outer_body"].by_name["dot_fusion.1"].cycles == 1000


def test_trip_counts_known_inferred_and_dynamic(module) -> None:
    entry = module.entry
    assert infer_trip_count(module, entry, entry.by_name["while.1"]) == (3, "inferred: iv[0] from 0 step 1 LT 3")
    body = module.computations["outer_body"]
    assert infer_trip_count(module, body, body.by_name["while.2"]) == (4, "known_trip_count")
    n, how = infer_trip_count(module, entry, entry.by_name["while.3"])
    assert n is None and how.startswith("bound not constant")


@pytest.mark.parametrize(("start", "step", "direction", "bound", "n"), [
    (0, 1, "LT", 4, 4), (0, 3, "LT", 10, 4), (0, 1, "LE", 4, 5), (10, -2, "GT", 0, 5), (5, -1, "GE", 0, 6),
    (0, 2, "NE", 8, 4), (7, 1, "LT", 3, 0), (0, 1, "GT", 4, None),
])  # fmt: skip
def test_iterations_of_a_counted_loop(start: int, step: int, direction: str, bound: int, n: int | None) -> None:
    assert count_iterations(start, step, direction, bound) == n


def test_estimate_sums_loops_branches_and_calls(module) -> None:
    r = estimate_cycles(module)
    assert r["total_cycles"] == TOTAL_LAST
    assert r["seconds"] == pytest.approx(TOTAL_LAST / 1.5e9)
    assert r["categories"] == {"conv/dot fusion": 3000, "loop fusion": 415, "loop fusion (reduce)": 120, "copy/transpose": 40}
    loops = {lp["while"]: (lp["trip"], lp["mult"], lp["body_cycles_per_iter"]) for lp in r["loops"]}
    assert loops == {"while.1": (3, 1, 1040), "while.2": (4, 3, 10), "while.3": (2.0, 1, 100)}
    assert [x for x in r["loops"] if x["while"] == "while.3"][0]["how"].startswith("DYNAMIC, assumed 2.0")
    counts = {x["name"]: (x["count"], x["total_cycles"], x["category"]) for x in r["top"]}
    assert counts["reduce_fusion.1"] == (12, 120, "loop fusion (reduce)")
    assert counts["lt_fusion.1"] == (4, 8, "loop fusion")
    assert counts["scale_fusion.3"] == (1, 200, "loop fusion") and "scale_fusion.2" not in counts
    assert r["top"][0]["name"] == "dot_fusion.1"
    # compare: 3 x (4 + 1) in while.2's condition, 2 + 1 in while.3's, one in the entry
    assert r["unestimated"] == {"compare": 19, "add": 17, "convert": 1, "custom-call:tpu_custom_call": 1}
    assert r["notes"] == ["conditional cond.1: branches [300, 200] cycles, took last (x1)"]


def test_branch_max_dynamic_trip_clock_and_a_supplied_kernel_time(module) -> None:
    assert estimate_cycles(module, branch="max")["total_cycles"] == TOTAL_LAST + 100
    assert estimate_cycles(module, dynamic_trip=5)["total_cycles"] == TOTAL_LAST + 3 * 100
    r = estimate_cycles(module, clock_ghz=1.0, custom_call_us={"splash_mha_fwd": 2.0})
    assert r["total_cycles"] == TOTAL_LAST + 2000 and r["seconds"] == pytest.approx((TOTAL_LAST + 2000) / 1e9)
    assert r["categories"]["custom-call"] == 2000 and "custom-call:tpu_custom_call" not in r["unestimated"]


def test_cli_prints_the_report_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cycles.json"
    assert main([str(FIXTURE), "--top", "3", "--json", str(out), "--custom-call-us", "splash_mha_fwd=2"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("total 6,575 cycles") and "while.1      trip    3" in text
    data = json.loads(out.read_text())
    assert data["total_cycles"] == 6575 and data["hlo"] == str(FIXTURE) and len(data["top"]) == 3
    assert [x["name"] for x in data["top"]] == ["dot_fusion.1", "splash_mha_fwd.1", "scale_fusion.1"]
    with pytest.raises(SystemExit) as bad:
        main([str(FIXTURE), "--custom-call-us", "splash_mha_fwd"])
    assert bad.value.code == 2


def test_text_without_an_entry_is_refused() -> None:
    with pytest.raises(ValueError, match="no ENTRY"):
        parse_hlo("HloModule m\n\n%f (p: f32[]) -> f32[] {\n  ROOT %p = f32[] parameter(0)\n}\n")


def test_aot_helpers(module) -> None:
    assert aot.make_stem("135m-lora-16x1024|attention=splash", ["remat=auto"]) == "135m-lora-16x1024_attention=splash_remat=auto"
    assert aot.find_mosaic_kernels(module) == {"splash_mha_fwd": 1}

    class Mem:
        argument_size_in_bytes, temp_size_in_bytes, output_size_in_bytes = 3 * 2**30, 2**30, 3 * 2**30
        alias_size_in_bytes, generated_code_size_in_bytes = 3 * 2**30, 10

    rec = aot.summarize_memory(Mem(), hbm_bytes=4 * 2**30)
    assert rec["hbm_need_bytes"] == 4 * 2**30 and rec["hbm_gb"] == 4.0 and rec["fits"]
    assert not aot.summarize_memory(Mem(), hbm_bytes=4 * 2**30 - 1)["fits"]


def _run_aot(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bench.aot", *args], cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is not None, reason="libtpu is installed here")
def test_aot_without_libtpu_exits_2_with_one_line(tmp_path: Path) -> None:
    done = _run_aot("135m-lora-16x1024", "--out", str(tmp_path))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == ["bench.aot: libtpu is not installed: pip install -e '.[tpu]' "
                                        "(any x86-64 Linux host; no TPU needed)"]  # fmt: skip
    assert not list(tmp_path.iterdir())


def test_aot_refuses_a_malformed_topology_or_case_before_loading_anything() -> None:
    for args, says in ((["135m-lora-16x1024", "--topology", "v5e"], "--topology takes NAME:AxB"),
                       (["135m-lorax-16x1024"], "case '135m-lorax-16x1024'")):  # fmt: skip
        done = _run_aot(*args)
        assert done.returncode == 2 and len(done.stderr.splitlines()) == 1 and says in done.stderr, done.stderr
