"""Test tiers and Hypothesis profiles for tests/ and proofs/.

Two tiers, one suite (README, "Tests"):

* the default run (``pytest``; ``addopts`` adds ``-m "not slow"``) leaves out the tests marked
  ``slow`` and runs every Hypothesis test at the ``quick`` budget;
* the slow tier (``pytest -m slow``) runs the tests marked ``slow`` *and every Hypothesis test
  again at the full ``ci`` budget*: here a Hypothesis test counts as slow, so no property loses
  examples, it only draws most of them in the second run.  ``.ci/run`` runs both.

A run "selects the slow tier" when its ``-m`` expression admits the ``slow`` marker (``-m slow``,
``-m ""``); it then loads the ``ci`` profile and sets ``NAPKIN_TEST_TIER=full`` for test modules
whose budgets are their own (the kernel fuzzer, ``test_grad``, the stateful machine); otherwise
``quick``.  ``HYPOTHESIS_PROFILE`` (``ci``, ``quick``, ``dev``) overrides the profile either way.
"""

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ci", derandomize=True, max_examples=25, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("quick", parent=settings.get_profile("ci"), max_examples=10)
settings.register_profile("dev", max_examples=100, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "quick"))


def _selects_slow(config) -> bool:
    """Whether this run's ``-m`` expression admits a test marked only ``slow``."""
    expr = (config.getoption("markexpr", "") or "").strip()
    if not expr:
        return True
    from _pytest.mark.expression import Expression
    try:
        return bool(Expression.compile(expr).evaluate(lambda name, **kw: name == "slow"))
    except Exception:  # noqa: BLE001 -- pytest reports a bad expression itself
        return False


def pytest_configure(config):
    full = _selects_slow(config)
    os.environ["NAPKIN_TEST_TIER"] = "full" if full else "quick"
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if full else "quick"))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """In the slow tier, every Hypothesis test is run too, at its full budget."""
    if os.environ.get("NAPKIN_TEST_TIER") != "full":
        return
    for item in items:
        if _is_hypothesis_test(item):
            item.add_marker(pytest.mark.slow)


def _is_hypothesis_test(item) -> bool:
    """A ``@given`` test, or the ``TestCase`` of a Hypothesis state machine."""
    if getattr(getattr(item, "obj", None), "is_hypothesis_test", False):
        return True
    return isinstance(getattr(getattr(item, "cls", None), "settings", None), settings)
