"""``python -m unirl_core.sft --recipe sft-shapes [--override a.b=v ...]``: an SFT run in this process."""

from __future__ import annotations

import argparse
import logging

from unirl_core.sft.config import load_sft_recipe
from unirl_core.sft.local import run_sft


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m unirl_core.sft", description=__doc__)
    ap.add_argument("--recipe", required=True, help="a shipped SFT recipe name (sft-*) or a YAML path")
    ap.add_argument("--override", action="append", default=[], help="a.b=value (repeatable)")
    ap.add_argument("--resume", default="latest", choices=("latest", "never"))
    ap.add_argument("--no-export", action="store_true", help="skip writing <root>/<run>/export")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_sft_recipe(args.recipe, args.override)
    run_sft(cfg, resume_from=args.resume, export=not args.no_export)


if __name__ == "__main__":
    main()
