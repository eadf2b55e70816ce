import os

import pytest
import torch

# Triton kernels run in its CPU interpreter without CUDA; the switch is read when a kernel is defined,
# so it is set here, before any test module can import kvmeans.ops.triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    yield
