"""KV transfer GB/s over UCX vs memcpy; same as ``tandem bench transfer``.

python bench/transfer.py [--sizes 1MiB,4MiB,16MiB,64MiB] [--tls tcp,self] [--json]
"""

import sys

from tandem.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "transfer", *sys.argv[1:]]))
