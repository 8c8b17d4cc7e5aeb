"""``python -m fcdp_lab.reliability``: the command of :mod:`fcdp_lab.reliability.reliability`."""
from fcdp_lab.reliability.reliability import main

raise SystemExit(main())
