"""``python -m kvmeans.cli <command>`` (also ``torchrun -m kvmeans.cli train ...``)."""
import sys

from kvmeans.cli import main

sys.exit(main())
