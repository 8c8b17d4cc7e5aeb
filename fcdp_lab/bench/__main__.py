"""``python -m fcdp_lab.bench``: the command of :mod:`fcdp_lab.bench.bench`."""
from fcdp_lab.bench.bench import main

raise SystemExit(main())
