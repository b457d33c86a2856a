"""``python -m auditor`` is the ``audit`` command."""

import sys

from auditor.cli.audit import main

if __name__ == "__main__":
    sys.exit(main())
