"""The longest tests first: scripts/python runs a pytest worker per core
(pytest-xdist), and workers take tests in collection order, so the
pretrained models' tests (tens of seconds each) start before the many
short ones instead of leaving one worker busy at the end. Within each group
the order is the collection's, so a module's tests stay together."""


def _long(item):
    return "pretrained" in item.nodeid or any(f in item.fixturenames for f in ("smollm2", "gemma3"))


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: not _long(item))  # stable: the long ones first, each group in its order
