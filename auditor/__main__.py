"""``python -m auditor`` is the ``audit`` command."""

import sys

from auditor._cli import main

if __name__ == "__main__":
    sys.exit(main())
