import argparse
import asyncio

from moebus.shared.config_cli import add_model_args, model_from_args
from moebus.shared.logs import setup_logging

from .config import FrontendConfig
from .server import serve_frontend


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m moebus.services.frontend")
    add_model_args(parser, FrontendConfig)
    cfg = model_from_args(FrontendConfig, parser.parse_args(argv))
    setup_logging("frontend")
    try:
        import uvloop

        uvloop.run(serve_frontend(cfg))
    except ImportError:
        asyncio.run(serve_frontend(cfg))


if __name__ == "__main__":
    main()
