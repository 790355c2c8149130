"""The docs' benchmark tables are what the benchmarks' JSON says (bench/tables.py): a table in
docs/benchmarks.md edited by hand, or JSON rerun without the docs rewritten, fails here."""

from __future__ import annotations

from bench import tables


def test_the_docs_tables_are_the_ones_the_json_gives():
    assert tables.main(["--check"]) == 0


def test_a_hand_edited_table_is_found_and_rewritten(tmp_path):
    docs = tmp_path / "benchmarks.md"
    real = (tables.REPO / "docs" / "benchmarks.md").read_text()
    assert "<!-- bench.tables:bounds -->" in real and "<!-- bench.tables:memory -->" in real
    edited = real.replace("| rollout |", "| rollout (typed by hand) |", 1)
    assert edited != real
    docs.write_text(edited)
    assert tables.main(["--check", "--docs", str(docs)]) == 1
    assert tables.main(["--docs", str(docs)]) == 0
    assert docs.read_text() == real


def test_the_bounds_table_reads_the_ratio_and_verdict_of_each_phase():
    table = tables.bounds()
    data = tables._load("bounds.json")
    for phase, row in data["phases"].items():
        line = next(x for x in table.splitlines() if x.startswith(f"| {phase} |"))
        if "error" not in row:
            assert f"**{row['ratio']:.2f}x**" in line and ("PASS" if row["passed"] else "FAIL") in line
