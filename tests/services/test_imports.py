"""shared/ never imports torch; the services import it only when they load a real engine/tokenizer."""
from __future__ import annotations

import subprocess
import sys

MODULES = ["moebus.shared.bus", "moebus.shared.service", "moebus.shared.messages", "moebus.devmodel.toy",
           "moebus.engine.port", "moebus.shared.probes", "moebus.shared.nats_server", "moebus.services.frontend",
           "moebus.services.balancer", "moebus.services.launcher", "moebus.services.cli",
           "moebus.services.worker", "moebus.services.tokenizer", "moebus.text.tokenizer",
           "moebus.text.serving_tokenizer", "moebus.text.prompt_render", "moebus.text.tool_parser_deepseek"]


def test_no_torch_on_import() -> None:
    code = f"import sys\nfor m in {MODULES!r}: __import__(m)\nassert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
