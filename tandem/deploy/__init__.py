"""Starting Tandem's processes: on this machine (local.py) and on Ray (ray_cluster/)."""
