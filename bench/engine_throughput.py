"""Engine throughput vs Hugging Face generate; same as ``tandem bench engine``.

python bench/engine_throughput.py [--json] [--model M] [--threads N]
"""

import sys

from tandem.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "engine", *sys.argv[1:]]))
