"""``python -m typedkv``: the same commands as ``typedkv``."""

import sys

from typedkv.tools.cli import main

sys.exit(main())
