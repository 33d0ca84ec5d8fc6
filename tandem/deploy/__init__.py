"""Starting Tandem's processes: on this machine (local.py) and, later, on Ray."""
