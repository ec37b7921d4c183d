"""Exporters: sinks that turn the event log into metrics, spans, log lines and traces.

Installed as ``hicache_obs.exporters``; import the one you need, e.g.
``hicache_obs.exporters.prometheus``. Each is optional and imported lazily.
"""
