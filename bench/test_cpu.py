"""Where the test suite's time goes, in CPU seconds (which a busy machine does not inflate).

    STEADYTRAIN_TEST_CPU=/tmp/cpu.jsonl make test
    python bench/test_cpu.py /tmp/cpu.jsonl [--top 40] [--json OUT]

Prints the costliest tests and files (the test's own CPU plus its child processes') and the sum
over 2 cores, the floor of `make test`'s wall time on CI's machine; --json writes the same.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = [json.loads(line) for line in args.report.read_text().splitlines() if line.strip()]
    for row in rows:
        row["cpu"] = row["own"] + row["children"]
    by_file: dict[str, float] = defaultdict(float)
    for row in rows:
        by_file[row["test"].split("::")[0]] += row["cpu"]
    total = sum(row["cpu"] for row in rows)
    print(
        f"{len(rows)} tests, {total:.0f} CPU s in all: {total / 2 / 60:.1f} min on 2 cores at best"
    )
    print(f"\n{'CPU s':>8} {'children':>8}  test (the {args.top} costliest)")
    for row in sorted(rows, key=lambda r: -r["cpu"])[: args.top]:
        print(f"{row['cpu']:8.1f} {row['children']:8.1f}  {row['test']}")
    print(f"\n{'CPU s':>8} {'share':>6}  file")
    for name, cpu in sorted(by_file.items(), key=lambda kv: -kv[1]):
        print(f"{cpu:8.1f} {cpu / total:6.1%}  {name}")
    if args.json:
        args.json.write_text(json.dumps({"total_cpu_s": total, "files": by_file, "tests": rows}))


if __name__ == "__main__":
    main()
