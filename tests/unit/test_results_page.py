"""The results page and its monthly archive (`benchmarks.results_page`), without running a benchmark.

A run must rewrite only its own block of RESULTS.md and append, never replace, in the archive; and the move of
the old appended RESULTS.md into the archive must have lost nothing (checked against the commit before it).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import subprocess
from pathlib import Path

import pytest

from benchmarks.results_page import (
    ARCHIVE_DIR,
    PAGE,
    Run,
    append_section,
    archive_header,
    bench_name,
    block_names,
    markers,
    month_of,
    record_run,
    render_block,
    render_section,
    replace_block,
    sections_by_month,
    split_sections,
)

ROOT = Path(__file__).resolve().parents[2]
# The last commit whose RESULTS.md held every section appended (before the page and the archive)
OLD_PAGE_COMMIT = "a852b52"


def _run(
    title: str = "Weight sync", stamp: str = "2027-01-05 10:00 UTC", table: str = "| a |\n|---|\n| 1 |"
) -> Run:
    return Run(
        title=title,
        stamp=stamp,
        machine="2 CPU cores (X; flags avx2)",
        command="python -m benchmarks.weight_sync --reps 3",
        table=table,
        raw_json=json.dumps({"x": 1}),
        commit="abc1234",
    )


def _page(*names: str) -> str:
    body = "".join(f"{markers(n)[0]}\nold {n}\n{markers(n)[1]}\n\ntext after {n}\n\n" for n in names)
    return f"# Benchmark results\n\nintro\n\n{body}<!-- bench-blocks-end -->\n\nstatic tail\n"


def test_bench_name_is_the_module_else_a_title_slug():
    assert bench_name("python -m benchmarks.trl_side_by_side --rounds 2", "x") == "trl_side_by_side"
    assert bench_name("scripts/gpu_check.sh", "GPU checks, H200") == "gpu_checks_h200"


def test_month_of():
    assert month_of("### Weight sync — 2026-12-04 14:26 UTC") == "2026-12"
    assert month_of("## test run was using the same 2 cores") is None


def test_replace_block_rewrites_only_its_block():
    page = _page("weight_sync", "lora")
    new = replace_block(page, "weight_sync", render_block("weight_sync", _run()))
    assert "old weight_sync" not in new and "old lora" in new
    assert "text after weight_sync" in new and "static tail" in new
    assert "Measured 2027-01-05 10:00 UTC, commit abc1234" in new
    assert "(full run: [results_archive/2027-01.md](results_archive/2027-01.md))" in new
    assert block_names(new) == ["weight_sync", "lora"]
    # Idempotent: the same run again gives the same page
    assert replace_block(new, "weight_sync", render_block("weight_sync", _run())) == new


def test_a_new_benchmark_gets_a_block_before_the_end_marker():
    page = _page("lora")
    new = replace_block(page, "placement", render_block("placement", _run("Placement")))
    assert block_names(new) == ["lora", "placement"]
    assert (
        new.index(markers("placement")[1]) < new.index("<!-- bench-blocks-end -->") < new.index("static tail")
    )
    with pytest.raises(ValueError):
        replace_block("<!-- bench:lora -->\nno end", "lora", "x")


def test_archive_appends_and_starts_a_month_with_its_header():
    first = append_section("", "2027-01", render_section(_run()))
    assert first.startswith(archive_header("2027-01"))
    second = append_section(first, "2027-01", render_section(_run(stamp="2027-01-06 09:00 UTC")))
    assert second.startswith(first.rstrip("\n")) and second.count("### Weight sync") == 2


def test_sections_ignore_fenced_headings_and_undated_ones_follow_a_neighbour():
    text = (
        "# Title\n\nintro\n\n## Summary — 2026-12-04\n\n```\n## Call CompiledFxGraph 13%\n```\n\n"
        "## Issue 6 — 2026-11-29, a heading\n## on two lines\n\n### Run — 2026-11-29 12:22 UTC\n\nx\n"
    )
    heads = [h for h, _ in split_sections(text)]
    assert heads == ["", "## Summary — 2026-12-04", "## Issue 6 — 2026-11-29, a heading", "## on two lines",
                     "### Run — 2026-11-29 12:22 UTC"]  # fmt: skip
    grouped = sections_by_month(text)
    assert [s.splitlines()[0] for s in grouped["2026-12"]] == ["# Title", "## Summary — 2026-12-04"]
    assert len(grouped["2026-11"]) == 3
    assert "".join(grouped["2026-12"] + grouped["2026-11"]) == text


def test_record_run_writes_archive_and_page(tmp_path):
    page = tmp_path / "RESULTS.md"
    page.write_text(_page("weight_sync", "lora"))
    archive, name = record_run(_run(), page_path=page, archive_dir=tmp_path / "archive")
    assert name == "weight_sync" and archive == tmp_path / "archive" / "2027-01.md"
    record_run(
        _run(stamp="2027-01-06 09:00 UTC", table="| b |"), page_path=page, archive_dir=tmp_path / "archive"
    )
    assert archive.read_text().count("### Weight sync — 2027-01-0") == 2  # both runs kept
    text = page.read_text()
    assert "| b |" in text and "| 1 |" not in text and "old lora" in text


def test_a_curated_block_is_not_rewritten(tmp_path):
    """A block of hand-picked rows (machines and dates side by side) keeps them: the run goes to the archive."""
    from benchmarks.results_page import CURATED, curated

    page = tmp_path / "RESULTS.md"
    page.write_text(_page("weight_sync", "lora").replace("old weight_sync", f"{CURATED}\n| row of a Xeon |"))
    assert curated(page.read_text(), "weight_sync") and not curated(page.read_text(), "lora")
    before = page.read_text()
    archive, name = record_run(_run(table="| new |"), page_path=page, archive_dir=tmp_path / "archive")
    assert name == "weight_sync" and page.read_text() == before
    assert "| new |" in archive.read_text()


def test_a_run_naming_its_block_keeps_the_modules_other_block(tmp_path):
    """One module, two blocks (trl_side_by_side on the small model and on SmolLM2): the named block is
    rewritten, the module's own block stays."""
    page = tmp_path / "RESULTS.md"
    page.write_text(_page("weight_sync"))
    run = dataclasses.replace(_run(table="| real |"), block="weight_sync_smollm2")
    _, name = record_run(run, page_path=page, archive_dir=tmp_path / "archive")
    text = page.read_text()
    assert name == "weight_sync_smollm2" and "| real |" in text and "old weight_sync" in text


def test_growth_replot_reads_the_archive_format(tmp_path):
    from benchmarks.growth import recorded_cells

    cell = {"preset": "small", "samples": 64, "length": 64, "step_s": 1.0}
    run = Run("GRPO step growth", "2027-01-05 10:00 UTC", "m", "python -m benchmarks.growth", "t",
              json.dumps({"cells": [cell]}))  # fmt: skip
    (tmp_path / "2027-01.md").write_text(append_section("", "2027-01", render_section(run)))
    assert recorded_cells(str(tmp_path), "2027-01-01 00:00") == [cell]
    assert recorded_cells(str(tmp_path), "2027-02-01 00:00") == []


def test_the_page_has_well_formed_blocks_for_make_bench():
    from benchmarks.run_all import BENCHES

    text = PAGE.read_text()
    names = block_names(text)
    assert len(names) == len(set(names))
    for name in names:
        start, end = markers(name)
        assert text.count(start) == 1 and text.count(end) == 1 and text.index(start) < text.index(end)
    for cmd in BENCHES:
        assert cmd[0].removeprefix("benchmarks.") in names
    assert text.count("<!-- bench-blocks-end -->") == 1


def _old_page() -> str:
    try:
        proc = subprocess.run(
            ["git", "show", f"{OLD_PAGE_COMMIT}:benchmarks/RESULTS.md"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        proc = None
    if proc is None or proc.returncode != 0:
        pytest.skip(f"commit {OLD_PAGE_COMMIT} not in this checkout (shallow clone or no git)")
    return proc.stdout


def test_the_archive_holds_every_line_and_section_of_the_old_page():
    old = _old_page()
    archives = {p.stem: p.read_text() for p in sorted(ARCHIVE_DIR.glob("????-??.md"))}
    have = collections.Counter(
        line for text in archives.values() for line in text.splitlines() if line.strip()
    )
    want = collections.Counter(line for line in old.splitlines() if line.strip())
    missing = want - have
    assert not missing, f"lines of the old RESULTS.md missing from the archive: {list(missing)[:5]}"
    for head, _ in split_sections(old):
        if not head:
            continue
        holders = [m for m, text in archives.items() if head + "\n" in text]
        assert len(holders) == 1, (head, holders)
        assert month_of(head) in (None, holders[0]), (head, holders)
    for month, text in archives.items():
        assert text.splitlines()[0] == archive_header(month).strip()
