"""``python -m fcdp_deepspeed.tools.converge``: the command of :mod:`fcdp_deepspeed.tools.converge.converge`."""
from fcdp_deepspeed.tools.converge.converge import main

raise SystemExit(main())
