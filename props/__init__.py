"""props: a property-based suite that proves the numerics claims tinylm rests on.

Run it with ``tinylm props`` (a table of every property), ``pytest --pyargs props``
or ``python -m pytest props``; against your own code with ``tinylm props --impl
package.module:object`` (protocol in :mod:`props.impl`). ``python -m props.mutate``
shows that the suite catches deliberate bugs; ``benchmarks/mutation.py`` measures its
mutation score with mutmut (``docs/mutation.md``).

Public pieces: :mod:`props.strategies` (hypothesis strategies), :mod:`props.stattests`
(statistical checks with stated false-alarm rates), :mod:`props.record`
(``record``/``check``/``prop``), :mod:`props.impl` (the protocol),
:mod:`props.runner` (run the suite, read results).
"""

from . import impl, record, stattests, strategies, tolerances
from .impl import FUNCTIONS, Implementation, ImplError, TinyLMImpl, load
from .record import check, prop
from .runner import PropertyResult, SuiteRun, run_suite
from .stattests import ALPHA, TestResult, binomial_test, mean_test, variance_test, z_threshold

__all__ = [
    "impl",
    "record",
    "stattests",
    "strategies",
    "tolerances",
    "FUNCTIONS",
    "Implementation",
    "ImplError",
    "TinyLMImpl",
    "load",
    "check",
    "prop",
    "PropertyResult",
    "SuiteRun",
    "run_suite",
    "ALPHA",
    "TestResult",
    "binomial_test",
    "mean_test",
    "variance_test",
    "z_threshold",
]
