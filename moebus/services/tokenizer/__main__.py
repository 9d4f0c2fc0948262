import argparse

from moebus.shared.config_cli import add_model_args, model_from_args
from moebus.shared.runner import run

from .config import TokenizerConfig
from .service import TokenizerService


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m moebus.services.tokenizer")
    add_model_args(parser, TokenizerConfig)
    run(TokenizerService(model_from_args(TokenizerConfig, parser.parse_args(argv))))


if __name__ == "__main__":
    main()
