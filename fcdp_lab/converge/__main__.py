"""``python -m fcdp_lab.converge``: the command of :mod:`fcdp_lab.converge.converge`."""
from fcdp_lab.converge.converge import main

raise SystemExit(main())
