"""``python -m anarchon_lite`` when the package is installed (the single file runs its own)."""

import sys

from anarchon_lite import main

sys.exit(main())
