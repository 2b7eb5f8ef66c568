"""`python -m cvl` (what `torchrun -m cvl train ...` runs)."""

import sys

from cvl.cli import main

sys.exit(main())
