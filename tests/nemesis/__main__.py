"""``python -m tests.nemesis --tier redis --seed 7 --duration 60``: one or more seeded
runs; prints each run's figures and anomalies and exits 1 if any was found.
``--tier all`` runs every tier; ``--seeds 5`` runs seeds seed .. seed+4 (the long mode:
``--duration 3600`` per run)."""

from __future__ import annotations

import argparse
import json
import sys

import nemesis  # noqa: F401  (sys.path)
from nemesis import runner

ALL = [*runner.LIB_TIERS, "celery", "rq", "beat", "cron"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.nemesis")
    parser.add_argument("--tier", default="all", help=f"one of {', '.join(ALL)}, or all")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--seeds", type=int, default=1, help="how many seeds from --seed")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per run")
    parser.add_argument("--keep", action="store_true", help="keep the history directories")
    parser.add_argument("--json", help="write every run's figures and anomalies here")
    parser.add_argument("--only", help="deal only these fault kinds (comma-separated), "
                        "e.g. concurrent-renew or sigstop,restart")  # fmt: skip
    args = parser.parse_args(argv)
    tiers = ALL if args.tier == "all" else args.tier.split(",")
    results, found = [], 0
    for seed in range(args.seed, args.seed + args.seeds):
        for tier in tiers:
            kinds = set(args.only.split(",")) if args.only else None
            result = runner.run(tier, seed, args.duration, kinds=kinds)
            print(result.report(), flush=True)
            found += len(result.anomalies)
            results.append({
                "tier": tier, "seed": seed, "figures": result.figures,
                "anomalies": [str(a) for a in result.anomalies], "workdir": str(result.workdir),
            })  # fmt: skip
            if not args.keep and not result.anomalies:
                runner.cleanup(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(f"{len(results)} runs, {found} anomalies")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
