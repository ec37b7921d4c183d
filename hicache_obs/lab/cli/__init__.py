"""The ``hicache-obs demo`` and ``hicache-obs bench`` commands (``register``/``run``, as
every command in :mod:`hicache_obs.cli`)."""
