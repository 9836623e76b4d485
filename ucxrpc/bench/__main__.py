"""``python -m ucxrpc.bench``."""

import sys

from . import main

sys.exit(main())
