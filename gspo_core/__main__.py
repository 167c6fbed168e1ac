"""`python -m gspo_core train job.yaml`."""

import sys

from gspo_core.cli import main

sys.exit(main())
