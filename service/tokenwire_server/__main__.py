"""`tokenwire-server` and `python -m tokenwire_server`."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from .config import build_parser, parse_config
    from .logs import configure_logging

    args = list(sys.argv[1:] if argv is None else argv)
    config = parse_config(args)
    configure_logging(config.log_level, config.log_format)
    if config.omp_spin_count:
        # libgomp reads this once, when torch loads it: nothing has imported torch yet.
        os.environ.setdefault("GOMP_SPINCOUNT", str(config.omp_spin_count))
    if build_parser().parse_args(args).prepare_only:
        from .model import ModelLoadError, resolve_model_path

        try:
            folder, _, name = resolve_model_path(config.model, config.cache_dir)
        except ModelLoadError as exc:
            print(f"tokenwire-server: error: {exc}", file=sys.stderr)
            return 2
        print(f"{name}: ready in {folder}")
        return 0

    from .server import print_config, serve

    print_config(config)
    return asyncio.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
