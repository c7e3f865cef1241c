"""Adversarial volunteers for security experiments (``ftis-lab attack``).

Each attacker is a real client process with its own Ed25519 key speaking the real
protocol; what it sends and the codes it gets back go to ``OUT/attack.jsonl``.

- :mod:`ftis.lab.attack.mutations`: pure bundle/feedback forgeries (unit-tested).
- :mod:`ftis.lab.attack.nodes`: one attacker class per kind, each wrapping an honest
  :class:`~ftis.client.node.runner.VolunteerNode` by composition (injected as its
  :class:`~ftis.client.node.runner.NodeHooks`), and the attack log.
- :mod:`ftis.lab.attack.runner`: builds and runs the node of a kind.
"""

#: Every attack kind; ``honest`` is the unmodified client with the same logging (control).
KINDS = (
    "honest",
    "reward_liar",
    "logprob_inflate",
    "logprob_deflate",
    "text_mismatch",
    "replay",
    "fabricated_prompt",
    "flooder",
    "garbage",
    "sybil_burst",
    "false_reporter",
    "replay_frame",
    "logprob_shade",
    "sybil_feedback",
    "answer_computer",
)
ATTACK_KINDS = KINDS[1:]
