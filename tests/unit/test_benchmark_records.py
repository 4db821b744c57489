"""Benchmark records: the writer, the results folder's layout, the generated index and the quoted-figure rule."""

import datetime
import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import common  # noqa: E402
import index  # noqa: E402
import quotes  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"


def test_write_record_keeps_other_cells_and_records_commit_and_date(tmp_path):
    common.write_record("toy", {"ratio": 0.7412}, "| a | b |\n|---|---|\n| 1 | 2 |", cell="cpu", env={"cpu": "x"},
                        description="A toy.", results_dir=tmp_path)
    common.write_record("toy", {"ratio": 0.5}, "| a |\n|---|\n| 3 |", cell="cuda", env={"gpu": "y"},
                        results_dir=tmp_path)
    common.write_record("toy", {"ratio": 0.6}, "| a |\n|---|\n| 4 |", cell="cuda", env={"gpu": "y"},
                        results_dir=tmp_path)
    rec = json.loads((tmp_path / "toy" / "latest.json").read_text())
    assert rec["description"] == "A toy."  # kept from the first write
    assert set(rec["cells"]) == {"cpu", "cuda"} and rec["cells"]["cuda"]["results"] == {"ratio": 0.6}
    cell = rec["cells"]["cpu"]
    assert re.fullmatch(r"[0-9a-f]{40}", cell["commit"]) and isinstance(cell["dirty"], bool)
    assert datetime.datetime.fromisoformat(cell["date"]).tzinfo is not None
    md = (tmp_path / "toy" / "latest.md").read_text()
    assert "## cpu" in md and "## cuda" in md and "| 4 |" in md and "| 3 |" not in md
    assert md == common.render_md(rec)


def test_write_record_single_and_name_checks(tmp_path):
    path = common.report("one", "One", ["k", "v"], [["ratio", 0.74]], {"ratio": 0.74}, results_dir=tmp_path)
    rec = json.loads(path.read_text())
    assert "cells" not in rec and rec["results"] == {"ratio": 0.74} and rec["env"]["cores"] > 0
    with pytest.raises(ValueError, match="a name, not a path"):
        common.write_record("a/b", {}, "", results_dir=tmp_path)


def test_results_folder_holds_only_records():
    stray = [p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*") if p.is_file()
             and p.parts[len(RESULTS.parts)] != "golden" and p.name not in ("latest.json", "latest.md")]
    assert stray == [], "results/ holds one <benchmark>/latest.{json,md} per benchmark (history is in git)"
    assert (RESULTS / "golden" / "pre-executor-seam.json").is_file()  # scripts/golden_runs.py reads it
    for name, rec in index.records().items():
        assert (RESULTS / name / "latest.md").read_text() == common.render_md(rec), f"{name}: latest.md is stale"
        assert rec["description"] and rec["script"] and (REPO / rec["script"]).is_file(), name
        for e in index.entries(rec):
            assert re.fullmatch(r"[0-9a-f]{40}", e["commit"]) and common.when(e), name
            assert "env" in e, name


def test_index_page_is_up_to_date():
    assert index.DOC.read_text() == index.render(), "run: PYTHONPATH=. python benchmarks/index.py"


def test_index_changes_when_a_record_does(tmp_path):
    common.write_record("toy", {"ratio": 0.74}, "| ratio |\n|---|\n| 0.74 |", env={"cpu": "x"},
                        description="A toy.", results_dir=tmp_path)
    doc = tmp_path / "docs" / "benchmarks.md"
    before = index.render(tmp_path, doc)
    assert "| toy | A toy. | ratio 0.74 | x |" in before and "(../toy/latest.md)" in before
    common.write_record("toy", {"ratio": 0.5}, "| ratio |\n|---|\n| 0.5 |", env={"cpu": "x"}, results_dir=tmp_path)
    assert index.render(tmp_path, doc) != before


def test_numbers_in_link_text():
    assert quotes.numbers("0.74x of flow_grpo's step at 4,895 tok/s, 16.9 GiB") == ["0.74", "4,895", "16.9"]
    assert quotes.numbers("Qwen3-0.6B on an H200 with sd35m, mb4") == []


def test_quote_check_accepts_figures_from_the_record_and_rejects_others(tmp_path):
    common.write_record("toy", {"ratio": 0.7412, "tok_s": 4895.2}, "| step s |\n|---|\n| 3.50 |",
                        env={"cpu": "x"}, results_dir=tmp_path)
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    good = ("[0.74x, 4,895 tok/s](../toy/latest.md) and [3.50 s](../toy/latest.json) "
            "`[9.99](../toy/latest.md)` in code is not a link\n```\n[8.88](../toy/latest.md)\n```\n")
    page.write_text(good)
    assert quotes.check_page(page, tmp_path) == []
    page.write_text("[0.75x of the reference](../toy/latest.md), [1.2](../nope/latest.md), "
                    "[old](../toy_rerun.json), see `benchmarks/results/toy_rerun.md`\n")
    problems = quotes.check_page(page, tmp_path)
    assert len(problems) == 4, problems
    assert "0.75 not measured in toy/latest.json" in problems[0]
    assert "no record nope/latest.json" in problems[1]
    assert "not a record" in problems[2] and "toy_rerun.md is not a record" in problems[3]


def test_a_quote_from_a_record_of_cells_names_its_cell_and_only_measured_numbers_count(tmp_path):
    common.write_record("sweep", {"z": 5.5}, "| z |\n|---|\n| 5.5 |", cell="seed0", env={"cpu": "x"},
                        results_dir=tmp_path)
    common.write_record("sweep", {"z": 1.7}, "| z |\n|---|\n| 1.7 |", cell="seed1", env={"cpu": "x"},
                        results_dir=tmp_path)
    year = json.loads((tmp_path / "sweep" / "latest.json").read_text())["cells"]["seed0"]["date"][:4]
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    page.write_text("[z 5.5](../sweep/latest.md#seed0) and [z 1.7](../sweep/latest.md#seed1)\n")
    assert quotes.check_page(page, tmp_path) == []
    page.write_text(f"[z 5.5](../sweep/latest.md), [z 5.5](../sweep/latest.md#seed1), [z 5.5](../sweep/latest.md#seed9), "
                    f"[{year}](../sweep/latest.md#seed0)\n")
    problems = quotes.check_page(page, tmp_path)
    assert len(problems) == 4, problems
    assert "holds several cells; name the one quoted" in problems[0]
    assert "5.5 not measured in sweep/latest.json (cell #seed1)" in problems[1]
    assert "has no cell #seed9" in problems[2]
    assert f"{year} not measured" in problems[3]  # the record's date is not a measurement


def test_write_record_refuses_to_mix_a_single_run_and_cells(tmp_path):
    common.write_record("one", {"a": 1}, "", env={}, results_dir=tmp_path)
    with pytest.raises(ValueError, match="one run, no cells; write this run without a cell"):
        common.write_record("one", {"a": 2}, "", cell="x", env={}, results_dir=tmp_path)
    common.write_record("many", {"a": 1}, "", cell="x", env={}, results_dir=tmp_path)
    with pytest.raises(ValueError, match=r"cells \['x'\]; write this run as one of its cells"):
        common.write_record("many", {"a": 2}, "", env={}, results_dir=tmp_path)
    assert json.loads((tmp_path / "many" / "latest.json").read_text())["cells"]["x"]["results"] == {"a": 1}


def test_quoted_figures_are_in_their_records():
    problems = [p for page in quotes.pages() for p in quotes.check_page(page)]
    assert problems == [], "\n".join(problems)
