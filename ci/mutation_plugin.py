"""pytest plugin for mutation runs (loaded by `[tool.mutmut] pytest_add_cli_args` in pyproject.toml).

Hypothesis stops at the first failing example: no shrinking, no explanation, one report. A killed
mutant then costs the examples up to the first failure instead of a long shrink (seconds to
minutes per mutant); which tests fail is unchanged. The settings of the profile that conftest.py
loaded (HYPOTHESIS_PROFILE) are kept otherwise."""

from hypothesis import Phase, settings


def pytest_configure(config):
    settings.register_profile("mutation", parent=settings.default,
                              phases=(Phase.explicit, Phase.reuse, Phase.generate), report_multiple_bugs=False)
    settings.load_profile("mutation")
