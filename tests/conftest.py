import os

import pytest
from hypothesis import HealthCheck, settings

from support.caches import clear_caches

settings.register_profile("ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _caches_made_afresh():
    """Every test fills the library's caches afresh (`support.caches`)."""
    clear_caches()
