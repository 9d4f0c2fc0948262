"""The CPU platform (platform.py) and its fast paths; see moebus/platforms/__init__.py for the map.
Imports no torch: flags.py, cores.py and core_share.py serve torch-free services."""
