"""``python -m tandem.decode_worker``: see tandem/worker/main.py."""

import sys

from tandem.worker.main import main

sys.exit(main("decode"))
