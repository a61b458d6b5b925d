import tiergen  # noqa: F401  (first: sets the CPU safety guard before torch runs a kernel)

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _no_process_group_left():
    """A test that fails while its parallel ranks run must not fail the tests after it."""
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
