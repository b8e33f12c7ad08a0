"""The pretrained models (loaded once a worker) and the longest tests first:
scripts/python runs a pytest worker per core (pytest-xdist), and workers take tests in collection order, so the
pretrained models' tests (tens of seconds each) start before the many
short ones instead of leaving one worker busy at the end. Within each group
the order is the collection's, so a module's tests stay together."""
import pytest


def _long(item):
    return "pretrained" in item.nodeid or any(f in item.fixturenames for f in ("smollm2", "gemma3"))


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: not _long(item))  # stable: the long ones first, each group in its order


def _load(name):
    import pathlib
    import sys
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples" / "python"))
    import pretrained
    try:
        return pretrained.load(name)
    except pretrained.NotInstalled as e:  # scripts/python installs their wheels
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def one_torch_thread():
    """For a pretrained model's module (pytestmark): OpenBLAS threads the products;
    torch's own threads on top of them only contend on 2 cores (a decode step 2.7x slower)."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Loaded once a worker (session fixtures, shared by test_pretrained.py and test_one_engine.py): the
# long tests run first, so other modules' tests may come between two of them, and a module fixture
# would load the model again (Gemma 3: 24-28 s each time).
@pytest.fixture(scope="session")
def smollm2():
    return _load("smollm2")


@pytest.fixture(scope="session")
def gemma3():
    return _load("gemma3")
