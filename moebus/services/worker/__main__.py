import argparse

from moebus.shared.config_cli import add_model_args, model_from_args
from moebus.shared.runner import run

from .config import WorkerConfig
from .service import WorkerService


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m moebus.services.worker")
    add_model_args(parser, WorkerConfig)
    cfg = model_from_args(WorkerConfig, parser.parse_args(argv))
    if cfg.ep > 1:
        from .ep import serve_ep_group

        serve_ep_group(cfg)
        return
    run(WorkerService(cfg))


if __name__ == "__main__":
    main()
