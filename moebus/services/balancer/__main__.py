import argparse

from moebus.shared.config_cli import add_model_args, model_from_args
from moebus.shared.runner import run

from .config import BalancerConfig
from .service import BalancerService


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m moebus.services.balancer")
    add_model_args(parser, BalancerConfig)
    run(BalancerService(model_from_args(BalancerConfig, parser.parse_args(argv))))


if __name__ == "__main__":
    main()
