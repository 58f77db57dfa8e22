"""``python -m sdfast``: the same command line as the ``sdfast`` console script (``sdfast.cli``)."""

from sdfast.cli import main

raise SystemExit(main())
