"""``python -m kvmeans <command>`` (also ``torchrun --nproc_per_node=N -m kvmeans train ...``)."""
import sys

from kvmeans.cli import main

sys.exit(main())
