import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from the same random state; torch's global RNG is restored afterwards."""
    state = torch.random.get_rng_state()
    torch.manual_seed(0)
    yield
    torch.random.set_rng_state(state)
