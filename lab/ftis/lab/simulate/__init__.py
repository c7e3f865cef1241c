"""``ftis-lab simulate``: N FTIS learners as Flower ClientApps in flwr's simulation
engine, with one ServerApp that plays the coordinator (issue 16, part 2).

Only :mod:`ftis.lab.simulate.flower` imports ``flwr``; the rest is plain FTIS:

* :mod:`~ftis.lab.simulate.spec`: what one simulated swarm is (:class:`SwarmSpec`), the
  learners' deterministic identities and configs, and the summary both swarms report;
* :mod:`~ftis.lab.simulate.coordinator`: the coordinator side over in-process state,
  the same handlers, verification and reputation as ``ftis-coordinator``;
* :mod:`~ftis.lab.simulate.learner`: the learner side, the volunteer's own
  :class:`~ftis.client.node.runner.VolunteerNode` on a connection whose answers came
  in the last Flower message, with its state kept in the ClientApp's context;
* :mod:`~ftis.lab.simulate.native`: the same swarm the real way (a gRPC coordinator and
  :class:`~ftis.client.swarm.connection.SwarmConnection` clients), the parity reference.

Only signed FTIS bundles, their verified rewards, relay pages and metrics travel in the
Flower messages, never weights. Flower stays off the volunteer path (docs/protocol.md).
"""
