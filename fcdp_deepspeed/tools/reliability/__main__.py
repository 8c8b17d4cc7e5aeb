"""``python -m fcdp_deepspeed.tools.reliability``: the command of :mod:`fcdp_deepspeed.tools.reliability.reliability`."""
from fcdp_deepspeed.tools.reliability.reliability import main

raise SystemExit(main())
