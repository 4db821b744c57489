"""``python -m unirl_core.runs <command>``: tools over a run the loop stored.

    python -m unirl_core.runs replay runs/tiny-flow-grpo --step 3 [--step 5 ...]
    python -m unirl_core.runs rescore runs/tiny-flow-grpo --reward aesthetic_proxy --reward 'clip_like={"x": 1}'

``replay`` rebuilds each step from what the run stored and checks it bit for bit (``unirl_core/runs/replay.py``;
exit status 1 and the first differing field on a mismatch). ``rescore`` scores the stored batches with other
rewards, without training (``unirl_core/runs/rescore.py``): a per-step table on stdout, a CSV and a page of charts under
``<run>/rescore/``. Both need a run trained with ``checkpoint.keep_batches: true``.
"""

from __future__ import annotations

import argparse
import logging
import sys

from unirl_core.errors import UniRLError


def _replay(args: argparse.Namespace) -> int:
    from unirl_core.runs.replay import ReplayMismatch, replay
    from unirl_core.runs.replay_compose import is_composed_run, replay_compose

    rebuild = replay_compose if is_composed_run(args.run) else replay
    status = 0
    for step in args.step:
        try:
            print(rebuild(args.run, step=step, keep=args.keep).summary())
        except ReplayMismatch as e:
            print(f"MISMATCH: {e}", file=sys.stderr)
            status = 1
    return status


def _rescore(args: argparse.Namespace) -> int:
    from unirl_core.runs.rescore import parse_reward_arg, rescore

    table = rescore(args.run, [parse_reward_arg(r) for r in args.reward], steps=args.step or None)
    print(table.markdown())
    print(f"\nwritten: {table.csv_uri}\n         {table.chart_uri}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m unirl_core.runs", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    rp = sub.add_parser("replay", help="rebuild steps from what the run stored and check them bit for bit")
    rp.add_argument("run", help="the run folder: <checkpoint.root>/<run name> (a path or an s3:// URL)")
    rp.add_argument("--step", type=int, action="append", required=True, help="a step to replay (repeatable)")
    rp.add_argument("--keep", action="store_true", help="keep the replayed versions under <run>/replay/")
    rp.set_defaults(fn=_replay)
    rs = sub.add_parser("rescore", help="score the run's stored batches with other rewards, without training")
    rs.add_argument("run", help="the run folder: <checkpoint.root>/<run name> (a path or an s3:// URL)")
    rs.add_argument("--reward", action="append", required=True,
                    help="a scorer name, or NAME=SCORER or SCORER=<JSON kwargs> (repeatable: one column each)")
    rs.add_argument("--step", type=int, action="append", default=[], help="only these steps (default: all stored)")
    rs.set_defaults(fn=_rescore)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.fn(args)
    except UniRLError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
