"""bench pretrained with the per-head floor (and most) overridden: FLOOR=0.333 MOST=4 python run.py ARGS...
(the runs here used this, formatted for the linter since; today `--kvm ...,exact_floor=F` does the same)"""
import os
import sys

from kvmeans.cli.__main__ import main
from kvmeans.pretrained import heads

floor = float(os.environ.get("FLOOR", heads.HEAD_FLOOR))
most = float(os.environ.get("MOST", heads.HEAD_MOST))
heads.head_caps.__defaults__ = (floor, most)
print(f"# head_caps floor={floor} most={most}", flush=True)
sys.exit(main())
