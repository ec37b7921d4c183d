"""The lab: what drives, measures and stands in for the product, never part of it.

- :mod:`hicache_obs.lab.workload`: the synthetic prefix-reuse serving workload;
- :mod:`hicache_obs.lab.bench`: the performance ratios behind ``hicache-obs bench``;
- :mod:`hicache_obs.lab.sglang`: SGLang on a CPU (its controllers, its tree cache and its
  HTTP server with stand-ins for the CUDA kernels) and the bench's bare floor;
- :mod:`hicache_obs.lab.cli`: the ``demo`` and ``bench`` commands.

The lab imports the product; the product never imports the lab (a test holds that). The
command line reaches the two lab commands by module name only.
"""
