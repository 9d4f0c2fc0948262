import argparse
import asyncio
import logging
import sys

from moebus.shared.config_cli import add_model_args, model_from_args

from .config import FrontendConfig
from .server import serve_frontend


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m moebus.services.frontend")
    add_model_args(parser, FrontendConfig)
    cfg = model_from_args(FrontendConfig, parser.parse_args(argv))
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s frontend %(levelname)s %(name)s: %(message)s")
    try:
        import uvloop

        uvloop.run(serve_frontend(cfg))
    except ImportError:
        asyncio.run(serve_frontend(cfg))


if __name__ == "__main__":
    main()
