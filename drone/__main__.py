"""``python -m hangar.drone``: the same as ``hangar drone``."""

import sys

from hangar.shared.cli import main

sys.exit(main(["drone", *sys.argv[1:]]))
