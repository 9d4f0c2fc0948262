import argparse

from moebus.shared.config_cli import add_model_args, model_from_args
from moebus.shared.runner import run

from .config import PlannerConfig
from .service import PlannerService


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m moebus.services.planner")
    add_model_args(parser, PlannerConfig)
    run(PlannerService(model_from_args(PlannerConfig, parser.parse_args(argv))))


if __name__ == "__main__":
    main()
