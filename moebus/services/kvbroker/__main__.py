import argparse

from moebus.shared.config_cli import add_model_args, model_from_args
from moebus.shared.runner import run

from .config import KVBrokerConfig
from .service import KVBrokerService


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m moebus.services.kvbroker")
    add_model_args(parser, KVBrokerConfig)  # sizes take units: --cpu-bytes 512M
    run(KVBrokerService(model_from_args(KVBrokerConfig, parser.parse_args(argv))))


if __name__ == "__main__":
    main()
