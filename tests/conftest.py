import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from the same random state; torch's global RNG is restored afterwards."""
    state = torch.random.get_rng_state()
    torch.manual_seed(0)
    yield
    torch.random.set_rng_state(state)


@pytest.fixture
def one_thread():
    """Tiny ops gain nothing from threads and stall on a shared, busy CPU; restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
