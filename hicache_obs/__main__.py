"""``python -m hicache_obs``: the ``hicache-obs`` command."""

from .cli import main

raise SystemExit(main())
