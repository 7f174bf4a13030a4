import os
import sys

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _launch_layouts_made_afresh():
    """Every test lays out its checksum launch blocks afresh: `checksum._PLANS` keeps them for the
    process, and a layout an earlier test (or mutmut's parent process) left there would spare a
    test the code that makes one."""
    checksum = sys.modules.get("reorder.batch.checksum")
    if checksum is not None:
        checksum._PLANS.clear()
