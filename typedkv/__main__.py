"""``python -m typedkv``: the same commands as ``typedkv``."""

import sys

from ._cli import main

sys.exit(main())
