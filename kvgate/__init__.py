"""kvgate: an inference gateway for Kubernetes (engine, endpoint picker, operator)."""

import os as _os

__version__ = "0.1.0"

# In a source checkout the operator lives in ./operator, which deliberately has no __init__.py: with the
# checkout on sys.path (`python -m ...` run from it), a package named `operator` there would shadow the
# standard library's. Wheels carry it as kvgate/operator; setuptools' editable finder cannot map a
# namespace folder under a regular package, so an editable install finds it through this path entry.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(__path__[0], "operator")) and _os.path.isfile(
        _os.path.join(_checkout, "operator", "naming.py")):
    __path__.append(_checkout)
