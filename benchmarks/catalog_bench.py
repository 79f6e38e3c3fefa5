"""What the catalog costs a listed row: `CatalogWriter.add` for every row, then `finish` (which also finds the rows
that repeat a path), in microseconds per row, for this checkout and, with --against DIR, another one.

    python benchmarks/catalog_bench.py [--rows 1000000] [--repeated 0.0] [--runs 5]
    git worktree add /tmp/base <commit> && python benchmarks/catalog_bench.py --against /tmp/base

The rows are ImageNet-like paths (61 characters, `datasets/imagenet21k/train/<wnid>/<wnid>_<n>.JPEG`), each a
fresh string as a list reader makes it; --repeated names that fraction of them twice (the repeats spread over the
list). Each checkout runs in its own fresh process, the two alternating, three rounds; each process takes the best
of --runs. It prints each round's numbers and, with --against, the difference and ratio of the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = """
import json, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from data_tools.builder.catalog import CatalogWriter
rows, repeated, runs = int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
ids = [f"datasets/imagenet21k/train/n{i % 1000:08d}/n{i % 1000:08d}_{i}.JPEG" for i in range(rows)]
step = int(1 / repeated) if repeated else 0
if step:
    ids = [ids[i - 1] if i % step == 0 and i else ids[i] for i in range(rows)]
adds, finishes = [], []
for _ in range(runs):
    with tempfile.TemporaryDirectory() as folder:
        try:
            writer = CatalogWriter(Path(folder), check_repeats=True)  # a list's catalog
        except TypeError:  # a checkout from before repeats were found
            writer = CatalogWriter(Path(folder))
        fresh = [s[:-1] + s[-1] for s in ids]
        start = time.perf_counter()
        for source_id in fresh:
            writer.add(source_id, 1, 0)
        added = time.perf_counter()
        catalog = writer.finish()
        finishes.append(time.perf_counter() - added)
        adds.append(added - start)
        catalog.close()
print(json.dumps({"add": min(adds) / rows * 1e6, "finish": min(finishes) / rows * 1e6}))
"""


def measure(tree: Path, rows: int, repeated: float, runs: int) -> dict[str, float]:
    """Microseconds per row of add and finish, the best of `runs`, in a fresh process importing `tree`."""
    out = subprocess.run([sys.executable, "-c", CHILD, str(tree), str(rows), str(repeated), str(runs)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows listed (default: %(default)s)")
    parser.add_argument("--repeated", type=float, default=0.0, help="fraction of rows naming a path twice")
    parser.add_argument("--runs", type=int, default=5, help="runs per process; the best is taken")
    parser.add_argument("--against", type=Path, default=None, help="another checkout to compare with")
    args = parser.parse_args()
    trees = {"this": REPO, **({"against": args.against.resolve()} if args.against else {})}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    print(f"{args.rows:,} rows, {args.repeated:.0%} repeated; µs per row, best of {args.runs} runs per process")
    for round_ in range(3):
        for name, tree in (trees.items() if round_ % 2 == 0 else reversed(trees.items())):
            got = measure(tree, args.rows, args.repeated, args.runs)
            results[name].append(got)
            print(f"round {round_ + 1}  {name:8s} add {got['add']:.3f}  finish {got['finish']:.3f}  "
                  f"total {got['add'] + got['finish']:.3f}")
    medians = {name: statistics.median(r["add"] + r["finish"] for r in rs) for name, rs in results.items()}
    for name, value in medians.items():
        print(f"median total, {name}: {value:.3f} µs per row")
    if args.against:
        print(f"this - against: {medians['this'] - medians['against']:+.3f} µs per row "
              f"({medians['this'] / medians['against']:.2f}x)")


if __name__ == "__main__":
    main()
