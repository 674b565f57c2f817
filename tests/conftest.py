import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest  # noqa: E402  (after the path set-up above)

# Files that start namespaced "nodes" and time a job's end: they share one xdist worker, so two never load the box
# at once.
NODE_FILES = {"test_nodes.py", "test_node_faults.py", "test_multinode.py"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist's ``--dist loadgroup`` (``launch/test.sh``): every test file runs whole on one worker, so
    its module fixtures and the harness's warm rank pools are made once per file, as in a serial run; the node files
    form one group, and go first: they are the longest, mostly waiting, and the other worker works meanwhile."""
    items.sort(key=lambda item: item.path.name not in NODE_FILES)  # stable: the rest keep their order
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group("nodes" if item.path.name in NODE_FILES else str(item.path)))
