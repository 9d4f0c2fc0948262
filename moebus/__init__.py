"""moebus: a serving stack for mixture-of-experts LLMs."""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

try:
    __version__ = _version("moebus")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.0.0+unknown"
