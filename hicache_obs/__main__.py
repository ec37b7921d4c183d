"""``python -m hicache_obs``: the ``hicache-obs`` command."""

try:
    from .cli import main
except KeyboardInterrupt:  # Ctrl-C before the command could take over: no traceback
    import sys

    print("hicache-obs: error: interrupted", file=sys.stderr)
    raise SystemExit(130) from None

raise SystemExit(main())
