"""``python -m fcdp_deepspeed.tools.bench``: the command of :mod:`fcdp_deepspeed.tools.bench.bench`."""
from fcdp_deepspeed.tools.bench.bench import main

raise SystemExit(main())
