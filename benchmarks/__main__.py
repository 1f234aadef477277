"""``python -m benchmarks NAME [ARGS]``: run one benchmark, show its output as it comes, and write
it as markdown to ``out/bench/NAME[-ARGS].md`` under a header with the machine, the date and the
command, the form of a BENCHMARKS.md section (``make bench`` runs every benchmark this way)."""

from __future__ import annotations

import datetime
import re
import subprocess
import sys
from pathlib import Path

from benchmarks.common import machine

ROOT = Path(__file__).parents[1]
FIGURE = re.compile(r"^(?P<name>[^|#].*): (?P<value>[-+]?[0-9.][^:]*)$")


def to_markdown(lines: list[str]) -> list[str]:
    """A benchmark's printed lines as markdown: its tables kept, ``# notes`` as text, ``## titles``
    as sub-headings and runs of ``name: value`` figures gathered into two-column tables."""
    out: list[str] = []
    figures: list[tuple[str, str]] = []

    def flush() -> None:
        if figures:
            out.extend(["", "| figure | value |", "|---|---|",
                        *(f"| {n} | {v} |" for n, v in figures), ""])
            figures.clear()

    for line in lines:
        if (m := FIGURE.match(line)) is not None:
            figures.append((m["name"], m["value"]))
            continue
        flush()
        if line.startswith("## "):
            out.extend(["", f"#{line}", ""])
        elif line.startswith("# "):
            out.append(line[2:])
        else:
            # a table starts and ends on a blank line
            edge = bool(out and out[-1] and line) and (
                line.startswith("|") != out[-1].startswith("|"))
            out.extend(["", line] if edge else [line])
    flush()
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m benchmarks NAME [ARGS]", file=sys.stderr)
        return 2
    name, args = argv[0], argv[1:]
    command = " ".join(["python -m benchmarks." + name, *args])
    proc = subprocess.Popen([sys.executable, "-m", f"benchmarks.{name}", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True, bufsize=1)
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        print(line, end="", flush=True)
        lines.append(line.rstrip("\n"))
    if proc.wait() != 0:
        return proc.returncode
    suffix = "".join("-" + a.lstrip("-").replace("/", "_") for a in args)
    page = [f"## {name}", "",
            f"Machine: {machine()}. Date: {datetime.date.today().isoformat()}. "
            f"Command: `{command}`.", "", *to_markdown(lines)]
    out = ROOT / "out" / "bench" / f"{name}{suffix}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(page).rstrip() + "\n", encoding="utf-8")
    print(f"-> {out.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
