"""BENCHMARKS.md cites only what exists: every record it names is in the repository and parses, every command names
a script of benchmarks/, and every row of a table with a record column names its record."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "BENCHMARKS.md"
MAX_LINES = 300


def code_spans(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


def tables(text: str) -> list[list[list[str]]]:
    """Each Markdown table as its rows of cells (header first, the separator row left out)."""
    found, rows = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if not all(re.fullmatch(r":?-+:?", cell) for cell in cells):
                rows.append(cells)
        elif rows:
            found.append(rows)
            rows = []
    return found


def scripts_named(command: str) -> list[str]:
    return re.findall(r"benchmarks/[\w./-]+\.(?:py|sh)", command)


def test_page_is_one_page():
    assert len(PAGE.read_text().splitlines()) <= MAX_LINES


def test_every_cited_record_exists_and_parses():
    records = [span for span in code_spans(PAGE.read_text()) if re.fullmatch(r"[\w./-]+\.(json|csv)", span)]
    assert records, "BENCHMARKS.md cites no record"
    for record in records:
        path = ROOT / record
        assert path.is_file(), f"BENCHMARKS.md cites {record}, which does not exist"
        if path.suffix == ".json":
            json.loads(path.read_text())


def test_every_command_names_an_existing_script():
    commands = [span for span in code_spans(PAGE.read_text()) if scripts_named(span)]
    assert commands
    for command in commands:
        for script in scripts_named(command):
            assert (ROOT / script).is_file(), f"{command!r} names {script}, which does not exist"


def test_every_row_names_its_command_machine_commit_and_record():
    checked = 0
    for rows in tables(PAGE.read_text()):
        header = [cell.lower() for cell in rows[0]]
        if "record" not in header:
            continue
        for row in rows[1:]:
            cells = dict(zip(header, row))
            assert len(row) == len(header), row
            assert re.fullmatch(r"`[\w./-]+\.(json|csv)`", cells["record"]), row
            assert scripts_named(cells["command"]), row
            assert cells["machine"] and cells["commit"], row
            checked += 1
    assert checked >= 10


def test_every_record_in_benchmarks_results_is_cited():
    """benchmarks/results/ holds what the page cites; older records lie beside the log (docs/benchmark_log/)."""
    cited = {Path(span).name for span in code_spans(PAGE.read_text()) if span.startswith("benchmarks/results/")}
    held = {path.name for path in (ROOT / "benchmarks" / "results").iterdir()}
    assert held <= cited, f"not cited by BENCHMARKS.md (move them to docs/benchmark_log/results/): {held - cited}"
