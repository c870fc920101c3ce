"""The results page and its archive: where a benchmark run's figures go, as pure text functions.

``benchmarks/RESULTS.md`` holds the current figures only, one block per benchmark between
``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->``, so a reader finds "how fast, on what" without reading
history. Every run's full section (machine, command, table, raw JSON) goes to the archive of its month,
``benchmarks/results_archive/YYYY-MM.md``, appended in the order the runs happened: nothing measured is
dropped, and the page stays a page. `benchmarks.common.record` calls `record_run`; everything else here
works on strings, so the page's rules are tested without running a benchmark
(tests/unit/test_results_page.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
PAGE = BENCH_DIR / "RESULTS.md"
ARCHIVE_DIR = BENCH_DIR / "results_archive"

_DATE = re.compile(r"(\d{4})-(\d{2})-\d{2}")
_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^#{2,3} ")
_MODULE = re.compile(r"python\d?(?:\.\d+)? -m benchmarks\.(\w+)")


@dataclass(frozen=True)
class Run:
    """One recorded run: what `record` knows when a benchmark finishes."""

    title: str
    stamp: str  # "YYYY-MM-DD HH:MM UTC"
    machine: str
    command: str
    table: str
    raw_json: str
    commit: str = ""  # the short git commit measured (its defaults); empty where unknown
    block: str = ""  # the page block's key where one module keeps two (e.g. a model of its own); else derived


def month_of(text: str) -> str | None:
    """``YYYY-MM`` of the first date in ``text``, or None."""
    m = _DATE.search(text)
    return f"{m.group(1)}-{m.group(2)}" if m else None


def bench_name(command: str, title: str) -> str:
    """The block's key: the module a ``python -m benchmarks.NAME`` command runs, else a slug of the title.

    The module, not the title, because one module is one benchmark whatever its arguments."""
    m = _MODULE.search(command)
    if m:
        return m.group(1)
    return re.sub(r"[^a-z0-9]+", "_", title.lower()).strip("_")


def archive_header(month: str) -> str:
    """The one-line header of a month's archive file."""
    return (
        f"# Benchmark results archive, {month}: every recorded run of the month, verbatim "
        "(current figures: [../RESULTS.md](../RESULTS.md))\n"
    )


def render_section(run: Run) -> str:
    """A run's full archive section: the format RESULTS.md sections always had (`growth.recorded_cells`
    parses the heading and the JSON block)."""
    head = f"\n### {run.title} — {run.stamp}\n\nMachine: {run.machine}  \nCommand: `{run.command}`\n"
    if run.commit:
        head = head[:-1] + f"  \nCommit: {run.commit}\n"
    return (
        f"{head}\n{run.table}\n\n"
        f"<details><summary>raw</summary>\n\n```json\n{run.raw_json}\n```\n</details>\n"
    )


def append_section(archive_text: str, month: str, section: str) -> str:
    """The archive file's text with ``section`` appended (the header first, for a new month)."""
    if not archive_text.strip():
        archive_text = archive_header(month)
    return archive_text.rstrip("\n") + "\n" + section


def markers(name: str) -> tuple[str, str]:
    return f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"


def render_block(name: str, run: Run) -> str:
    """The page's block for ``name``: title, when, on what, how, the table, and where the full run is."""
    start, end = markers(name)
    month = month_of(run.stamp) or "unknown"
    commit = f", commit {run.commit}" if run.commit else ""
    return (
        f"{start}\n### {run.title}\n\n"
        f"Measured {run.stamp}{commit} on {run.machine}.  \n"
        f"Command: `{run.command}` (full run: [results_archive/{month}.md](results_archive/{month}.md))\n\n"
        f"{run.table.strip()}\n{end}"
    )


def replace_block(page: str, name: str, block: str) -> str:
    """``page`` with the block of ``name`` replaced by ``block``; every other block and line kept.

    A benchmark without a block yet gets one before ``<!-- bench-blocks-end -->`` (else at the end), so a new
    benchmark's first run appears on the page without editing it by hand."""
    start, end = markers(name)
    i = page.find(start)
    if i >= 0:
        j = page.find(end, i)
        if j < 0:
            raise ValueError(f"{start} without {end} in the results page")
        return page[:i] + block + page[j + len(end) :]
    tail = "<!-- bench-blocks-end -->"
    k = page.find(tail)
    if k < 0:
        return page.rstrip("\n") + "\n\n" + block + "\n"
    return page[:k] + block + "\n\n" + page[k:]


# A block whose rows were put together by hand (several machines and dates in one table) says so on the line
# after its start marker; a run then goes to the archive only, and its row is added by hand.
CURATED = "<!-- curated: rows added by hand from the archive; a run does not rewrite this block -->"


def curated(page: str, name: str) -> bool:
    """Whether the page's block of ``name`` is curated (`CURATED`)."""
    start, _ = markers(name)
    i = page.find(start)
    return i >= 0 and page[i + len(start) :].lstrip("\n").startswith(CURATED)


def block_names(page: str) -> list[str]:
    """The names of the page's blocks, in page order."""
    return re.findall(r"<!-- bench:(\w+) -->", page)


def split_sections(text: str) -> list[tuple[str, str]]:
    """``text`` cut before each ``##`` / ``###`` heading outside code fences: (heading line, section text).

    The part before the first heading is returned with an empty heading. Fences matter: profiler tables
    in the old sections have lines starting with ``## Call CompiledFxGraph``."""
    out: list[tuple[str, list[str]]] = [("", [])]
    fenced = False
    for line in text.splitlines(keepends=True):
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced and _HEADING.match(line):
            out.append((line.rstrip("\n"), []))
        out[-1][1].append(line)
    return [(head, "".join(body)) for head, body in out if head or "".join(body).strip()]


def sections_by_month(text: str) -> dict[str, list[str]]:
    """The sections of ``text`` grouped by the month of their heading's date, in their order.

    A section whose heading has no date (a heading's second line, the preamble) goes to the month of the
    section before it, or of the first dated one after it when it comes first."""
    sections = split_sections(text)
    months: list[str | None] = [month_of(head) for head, _ in sections]
    first = next((m for m in months if m), None)
    if first is None:
        raise ValueError("no dated section")
    current = first
    grouped: dict[str, list[str]] = {}
    for (_, body), month in zip(sections, months, strict=True):
        current = month or current
        grouped.setdefault(current, []).append(body)
    return grouped


def record_run(run: Run, page_path: Path = PAGE, archive_dir: Path = ARCHIVE_DIR) -> tuple[Path, str]:
    """Append ``run`` to its month's archive and rewrite its block on the page (not a `curated` one); returns
    (archive, block name)."""
    month = month_of(run.stamp)
    if month is None:
        raise ValueError(f"run stamp without a date: {run.stamp!r}")
    archive_dir.mkdir(parents=True, exist_ok=True)
    archive = archive_dir / f"{month}.md"
    old = archive.read_text() if archive.exists() else ""
    archive.write_text(append_section(old, month, render_section(run)))
    name = run.block or bench_name(run.command, run.title)
    page = page_path.read_text() if page_path.exists() else "# Benchmark results\n"
    if not curated(page, name):
        page_path.write_text(replace_block(page, name, render_block(name, run)))
    return archive, name
