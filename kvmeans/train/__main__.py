"""``python -m kvmeans.train`` (see :mod:`kvmeans.train.cli`)."""
import sys

from .cli import main

sys.exit(main())
