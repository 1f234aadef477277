"""`dynquant demo` quiet vs beside one busy process.

The demo runs as a child process twice per round: alone, then with one competing process that
spins a core (`while True: pass`) for the whole run; rounds alternate so drift hits both alike.
Target: under load <= 2.5x the quiet time on a 2-core machine.

    python -m benchmarks.demo_under_load [--rounds N]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time

from benchmarks.common import figure, machine

SPIN = "while True: pass"


def demo_seconds(out: str, busy: bool) -> float:
    spinner = subprocess.Popen([sys.executable, "-c", SPIN]) if busy else None
    try:
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "dynquant", "demo", "--output", out],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return time.perf_counter() - start
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    print(f"# dynquant demo quiet vs one busy process, {machine()}")
    quiet, loaded = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            quiet.append(demo_seconds(f"{tmp}/q{r}", busy=False))
            loaded.append(demo_seconds(f"{tmp}/l{r}", busy=True))
    figure("demo quiet (best)", min(quiet), "s")
    figure("demo beside one busy process (best)", min(loaded), "s")
    figure("under load / quiet", min(loaded) / min(quiet), "x")


if __name__ == "__main__":
    main()
