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


@pytest.fixture(scope="module")
def one_thread_module():
    """One torch thread for a whole module (its timings and reductions do not depend on the core count)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
