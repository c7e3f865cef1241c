"""``ftis-lab``: research and security tooling around the volunteer client (not for
volunteers, who install only ``ftis-client``).

- :mod:`ftis.lab.attack`: adversarial volunteers that wrap the honest
  :class:`~ftis.client.node.runner.VolunteerNode` by composition (its ``hooks``).
- :mod:`ftis.lab.experiment`: local swarms (launcher), the demo's report, experiment
  matrices, the security experiment and their statistics.
- :mod:`ftis.lab.harness`: an in-process coordinator with a fake clock
  (:mod:`~ftis.lab.harness.coordinator`) and the bundle-verification fuzzers built on it
  (:mod:`~ftis.lab.harness.fuzz`), shared by ``tests/`` and ``bench/``.
- :mod:`ftis.lab.cli`: the ``ftis-lab`` command (``demo``, ``experiment``, ``attack``,
  ``security-experiment``).
"""
