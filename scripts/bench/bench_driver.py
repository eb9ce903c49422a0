"""Benchmarks: e2 apply vs git am, e2 verify, e2 rebase vs git rebase (20 patches).

Run: python scripts/bench/bench_driver.py [--repeat N] [--only apply|rebase]

Both sides run as commands in the same run, on the same base, from the same
upstream cache. The baselines are what a person would type by hand: a shared
clone at the tag and `git am --3way` of the 20 patches; for the rebase, a
shared clone holding the series and `git rebase --onto` the new release (no
report, no checks, no regenerated files).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2.cache import Cache  # noqa: E402
from series20 import build  # noqa: E402

APPLY_TARGET = 1.2
VERIFY_TARGET_S = 15.0
REBASE_TARGET = 1.5
REBASE_ONTO = "0.32.0"


def timed(command: list[str], cwd: Path) -> float:
    start = time.perf_counter()
    subprocess.run(command, cwd=cwd, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--only", choices=("apply", "rebase"),
                        help="run only the apply part (e2 apply, e2 verify) or the rebase part")
    args = parser.parse_args()
    ok = True
    with tempfile.TemporaryDirectory(prefix="e2-bench-") as tmp:
        root = build(Path(tmp) / "project")
        cache = Cache.at(None).upstream_repo  # where `e2 apply` imported upstream
        print(f"20-patch series, median of {args.repeat} runs")
        if args.only != "rebase":
            ok &= bench_apply(root, cache, Path(tmp), args.repeat)
        if args.only != "apply":
            ok &= bench_rebase(root, cache, Path(tmp), args.repeat)
    print("PASS" if ok else "OVER TARGET")
    return 0 if ok else 1


def bench_apply(root: Path, cache: Path, tmp: Path, repeat: int) -> bool:
    """e2 apply against git clone+checkout+am --3way, and e2 verify alone."""
    patches = sorted(str(p) for p in (root / "patches").glob("*.patch"))
    e2_times, git_times = [], []
    for round_ in range(repeat):
        out = tmp / f"e2-{round_}"
        e2_times.append(timed(["e2", "apply", "--out", str(out)], root))
        base = tmp / f"git-{round_}"
        start = time.perf_counter()
        subprocess.run(["git", "clone", "-q", "--shared", "--no-checkout", str(cache),
                        str(base)], check=True)
        subprocess.run(["git", "checkout", "-q", "-b", "e2", "refs/tags/v0.31.0"],
                       cwd=base, check=True)
        subprocess.run(["git", "-c", "user.name=b", "-c", "user.email=b@b", "am", "-q",
                        "--3way", *patches], cwd=base, check=True)
        git_times.append(time.perf_counter() - start)
    verify_times = [timed(["e2", "verify"], root) for _ in range(repeat)]
    e2_apply, git_am = statistics.median(e2_times), statistics.median(git_times)
    ratio = e2_apply / git_am
    verify = statistics.median(verify_times)
    print(f"  git clone+checkout+am --3way  {git_am:6.2f} s   (baseline)")
    print(f"  e2 apply                      {e2_apply:6.2f} s   ratio {ratio:.2f} "
          f"(target <= {APPLY_TARGET})")
    print(f"  e2 verify                     {verify:6.2f} s   (target < {VERIFY_TARGET_S:.0f} s)")
    return ratio <= APPLY_TARGET and verify < VERIFY_TARGET_S


def bench_rebase(root: Path, cache: Path, tmp: Path, repeat: int) -> bool:
    """e2 rebase (report, checks, export and verify included) against git clone+checkout+
    rebase --onto of the same commits, back to back in each round."""
    rebase_times, git_rebase_times = [], []
    subprocess.run(["e2", "apply", "--out", str(tmp / "series")], cwd=root,
                   check=True, capture_output=True)
    for round_ in range(repeat):
        copy = tmp / f"rebase-{round_}"
        shutil.copytree(root, copy, ignore=shutil.ignore_patterns(".e2"))
        rebase_times.append(timed(["e2", "rebase", "--onto", REBASE_ONTO], copy))
        base = tmp / f"git-rebase-{round_}"
        start = time.perf_counter()
        subprocess.run(["git", "clone", "-q", "--shared", "--no-checkout", str(cache),
                        str(base)], check=True)
        subprocess.run(["git", "fetch", "-q", str(tmp / "series"), "e2:series"],
                       cwd=base, check=True)
        subprocess.run(["git", "checkout", "-q", "series"], cwd=base, check=True)
        subprocess.run(["git", "-c", "user.name=b", "-c", "user.email=b@b", "rebase", "-q",
                        "--onto", f"refs/tags/v{REBASE_ONTO}", "refs/tags/v0.31.0"],
                       cwd=base, check=True, capture_output=True)
        git_rebase_times.append(time.perf_counter() - start)
    e2_rebase, git_rebase = statistics.median(rebase_times), statistics.median(git_rebase_times)
    rebase_ratio = e2_rebase / git_rebase
    print(f"  git clone+checkout+rebase     {git_rebase:6.2f} s   (baseline, onto {REBASE_ONTO})")
    print(f"  e2 rebase (report included)   {e2_rebase:6.2f} s   ratio {rebase_ratio:.2f} "
          f"(target <= {REBASE_TARGET})")
    return rebase_ratio <= REBASE_TARGET


if __name__ == "__main__":
    sys.exit(main())
