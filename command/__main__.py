"""``python -m command ...`` runs the ``pathways`` command (what the console script runs)."""

import sys

from command.main import main

sys.exit(main())
