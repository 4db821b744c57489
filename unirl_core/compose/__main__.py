"""``python -m unirl_core.compose replay <root>/<run> --step k [--step ...]``: replay steps of a composed run bit for
bit (``unirl_core/compose/replay.py``; exit status 1 and the first differing field on a mismatch). Re-scoring a
composed run is the loop's tool: ``python -m unirl_core.loop rescore <root>/<run> --reward NAME=SCORER@0``."""

from __future__ import annotations

import argparse
import logging
import sys

from unirl_core.errors import UniRLError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m unirl_core.compose", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    rp = sub.add_parser("replay", help="rebuild steps of a composed run and check them bit for bit")
    rp.add_argument("run", help="the run folder: <checkpoint.root>/<run name> (a path or an s3:// URL)")
    rp.add_argument("--step", type=int, action="append", required=True, help="a step to replay (repeatable)")
    rp.add_argument("--keep", action="store_true", help="keep the replayed versions under <run>/replay/")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from unirl_core.compose.replay import replay_compose
    from unirl_core.loop.replay import ReplayMismatch

    status = 0
    for step in args.step:
        try:
            print(replay_compose(args.run, step=step, keep=args.keep).summary())
        except ReplayMismatch as e:
            print(f"MISMATCH: {e}", file=sys.stderr)
            status = 1
        except UniRLError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return status


if __name__ == "__main__":
    sys.exit(main())
