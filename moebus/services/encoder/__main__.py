import argparse

from moebus.shared.config_cli import add_model_args, model_from_args
from moebus.shared.runner import run

from .config import EncoderConfig
from .service import EncoderService


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m moebus.services.encoder")
    add_model_args(parser, EncoderConfig)
    run(EncoderService(model_from_args(EncoderConfig, parser.parse_args(argv))))


if __name__ == "__main__":
    main()
