"""SGLang on a CPU, for the tests, the demo and the bench.

- :mod:`.harness`: real SGLang controllers built on this machine's CPU (``prepare``,
  ``build_controller``), with the CPU stand-ins of SGLang's CUDA kernels (:mod:`.kernels`);
- :mod:`.tree`: SGLang's own tree cache driving a controller (``drive_tree``);
- :mod:`.engine`: SGLang's controller behind the demo's engine API;
- :mod:`.server`, :mod:`.server_demo`, :mod:`.cpu_server` and its ``cpu_*`` stand-ins: the
  real ``sglang.launch_server`` on a CPU with a tiny model;
- :mod:`.deferred`: copies run off the controller's thread, as a GPU runs its kernels;
- :mod:`.floor`: the bare controller the bench's ``sglang`` section compares against.

Nothing here is imported by the adapter (:mod:`hicache_obs.integrations.sglang`).
"""
