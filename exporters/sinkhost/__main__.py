"""``python -m hicache_obs.exporters.sinkhost``: the sink host child (see :mod:`.child`)."""

import sys

from ._child import main

sys.exit(main())
